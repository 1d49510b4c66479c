"""A small, real byte-level BPE tokenizer with a ChatML chat template, the same bytes every time.

`governor make-model` gives every random-weight checkpoint this tokenizer, so tests, demos and
benchmarks exercise the real tokenizer path (BPE merges, special tokens, a chat template, BOS)
without downloading one. It is trained on an English-like corpus generated here from a fixed
seed: common words encode to one or two tokens, and any string round-trips through the byte
alphabet.

Conventions (the same as Llama 3): encoding a plain text prepends `<|begin_of_text|>`; the chat
template renders the BOS itself, so a rendered chat prompt is tokenized with
`add_special_tokens=False`. An assistant turn ends with `<|im_end|>`; `<|end_of_text|>` ends a
document.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Appended after the trained vocabulary, as Llama 3 and Qwen place theirs, so the ids below are fixed.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN)

# 256 byte tokens + merges. Deliberately not a multiple of 64, so a checkpoint's embedding has the
# padding rows real models have (config vocab_size > tokenizer size).
BPE_VOCAB_SIZE = 1995
VOCAB_SIZE = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)  # 2000
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(BPE_VOCAB_SIZE, VOCAB_SIZE)

# ChatML, as Qwen writes it, with Llama 3's leading BOS. Message content may be a string or a list
# of {"type": "text", "text": ...} parts (the OpenAI form); other roles are refused, not guessed.
#
# Tools, Hermes-style (as Qwen2.5 and Qwen3 take them, so the `hermes` tool-call parser reads the output):
# `tools` become a system block listing each function's JSON signature inside <tools></tools>, after the
# conversation's own system message when it opens with one; an assistant's `tool_calls` are <tool_call>
# blocks of {"name": ..., "arguments": {...}}, written as the parser returns them, so a call sent back
# renders as it was generated; tool results are <tool_response> blocks, consecutive ones in one user
# turn. A tool message must answer an assistant's tool_calls. A conversation without tools, tool calls
# or tool messages renders as plain ChatML.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{%- set tools_text = '# Tools\\n\\nYou can call functions to help with the request. Their signatures, in"
    " JSON Schema, are inside <tools></tools>:\\n<tools>\\n' + (tools | map('tojson') | join('\\n'))"
    " + '\\n</tools>\\n\\nTo call functions, answer with one <tool_call></tool_call> block per call, each"
    " holding a JSON object with the function name and its arguments:\\n<tool_call>\\n"
    "{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\\n</tool_call>' %}"
    "{%- if not (messages and messages[0]['role'] == 'system') %}"
    "{{- '<|im_start|>system\\n' + tools_text + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- set ns = namespace(answering=false) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool']"
    " or (message['role'] == 'tool' and not ns.answering) %}"
    "{{- raise_exception('role must be system, user or assistant (or tool, answering an assistant message"
    " with tool_calls), got ' + message['role']) }}"
    "{%- endif %}"
    "{%- if message['content'] is string %}"
    "{%- set content = message['content'] %}"
    "{%- elif message['content'] is none %}"
    "{%- set content = '' %}"
    "{%- else %}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{%- set calls = message['tool_calls'] if message['role'] == 'assistant' and message['tool_calls'] is defined"
    " and message['tool_calls'] else [] %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif calls %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in calls %}"
    "{%- set function = call['function'] if call['function'] is defined else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": '"
    " + (function['arguments'] if function['arguments'] is string else (function['arguments'] | tojson))"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif tools and loop.first and message['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + content + '\\n\\n' + tools_text + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns.answering = message['role'] == 'tool' or calls | length > 0 %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_CORPUS_SEED = 1234
_CORPUS_SENTENCES = 6000

# Kept as text (not a list literal) so the word lists stay readable.
_WORD_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or
had by hot word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing
see him two has look more day could go come did number sound no most people my over know water than
call first who may down side been now find any new work part take get place made live where after
back little only round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right boy old too
same tell does set three want air well also play small end put home read hand port large spell add
even land here must big high such follow act why ask men change went light kind off need house
picture try us again animal point mother world near build self earth father head stand own page
should country found answer school grow study still learn plant cover food sun four between state
keep eye never last let thought city tree cross farm hard start might story saw far sea draw left
late run while press close night real life few north open seem together next white children begin
got walk example ease paper group always music those both mark often letter until mile river car
feet care second book carry took science eat room friend began idea fish mountain stop once base
hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red
list though feel talk bird soon body dog family direct pose leave song measure door product black
short numeral class wind question happen complete ship area half rock order fire south problem piece
told knew pass since top whole king space heard best hour better true during hundred five remember
step early hold west ground interest reach fast verb sing listen six table travel less morning ten
simple several vowel toward war lay against pattern slow center love person money serve appear road
map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark
machine note wait plan figure star box noun field rest correct able pound done beauty drive stood
contain front teach week final gave green quick develop ocean warm free minute strong special mind
behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object
decide surface deep moon island foot system busy test record boat common gold possible plane model
server request token cache memory latency engine queue batch kernel prompt answer
"""
_WORDS = tuple(_WORD_TEXT.split())

_SYLLABLE_TEXT = """
ba be bi bo ca ce co da de di do fa fe fi ga ge go ha he hi ho ka ke ki ko la le li lo lu ma me mi
mo na ne ni no pa pe pi po ra re ri ro sa se si so ta te ti to va ve vi wa we ya zo an en in on un
ar er ir or ur al el il ol ter der ver ber ing tion ment ness able ous ful less ist ism ly est
"""
_SYLLABLES = tuple(_SYLLABLE_TEXT.split())

_PUNCTUATION = (".", ".", ".", "!", "?", ";", ",")


def _pick(rng: random.Random, items: tuple[str, ...]) -> str:
    # Only Random.random() is guaranteed to give the same sequence on every Python version.
    return items[int(rng.random() * len(items))]


def _pseudo_word(rng: random.Random) -> str:
    return "".join(_pick(rng, _SYLLABLES) for _ in range(1 + int(rng.random() * 3)))


def _sentence(rng: random.Random) -> str:
    words = []
    for _ in range(4 + int(rng.random() * 12)):
        r = rng.random()
        if r < 0.80:
            words.append(_pick(rng, _WORDS))
        elif r < 0.93:
            words.append(_pseudo_word(rng))
        else:
            words.append(str(int(rng.random() * 10 ** (1 + int(rng.random() * 4)))))
        if rng.random() < 0.07:
            words[-1] += ","
    words[0] = words[0].capitalize()
    if rng.random() < 0.08:
        words[1 + int(rng.random() * (len(words) - 1))] = f'"{_pick(rng, _WORDS)}"'
    return " ".join(words) + _pick(rng, _PUNCTUATION)


def corpus() -> list[str]:
    """The training text: paragraphs of English-like sentences generated from a fixed seed."""
    rng = random.Random(_CORPUS_SEED)
    sentences = [_sentence(rng) for _ in range(_CORPUS_SENTENCES)]
    return [" ".join(sentences[i:i + 5]) + "\n" for i in range(0, len(sentences), 5)]


@functools.lru_cache(maxsize=1)
def _trained_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    # GPT-2's split regex, then bytes → printable unicode: every string has an encoding.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training produced {tokenizer.get_vocab_size()} tokens, expected "
                           f"{BPE_VOCAB_SIZE}: the corpus no longer supports that many merges")
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, BOS_ID)],
        ),
    ])
    return tokenizer.to_str()


def build_tokenizer() -> Tokenizer:
    """The trained tokenizer (a fresh object each call; training runs once per process).

    Byte-level BPE of `VOCAB_SIZE` ids: 256 byte tokens, merges learned from `corpus()`, then the
    special tokens at ids `BOS_ID`, `EOS_ID`, `IM_START_ID`, `IM_END_ID`, `PAD_ID`.
    """
    tokenizer = Tokenizer.from_str(_trained_json())
    for token in SPECIAL_TOKENS:
        assert tokenizer.token_to_id(token) is not None, token
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict[str, object]:
    """tokenizer_config.json: what transformers' AutoTokenizer needs beyond tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        # Cleaning spaces before punctuation would break exact round trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, token in zip(range(BPE_VOCAB_SIZE, VOCAB_SIZE), SPECIAL_TOKENS, strict=True)
        },
    }


def write_tokenizer(out_dir: str | Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Pretty-printed through json so the file is stable and diffable.
    (out_dir / "tokenizer.json").write_text(
        json.dumps(json.loads(build_tokenizer().to_str()), indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(model_max_length))
    _write_json(out_dir / "special_tokens_map.json",
                {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
                 "additional_special_tokens": [IM_START, IM_END]})


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
