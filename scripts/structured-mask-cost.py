"""What a structured-output request costs the host, per grammar library, on a large byte-level BPE vocabulary (CPU).

    python3 scripts/structured-mask-cost.py [--vocab 32000,128000] [--walks 5] [--repeats 5]
        [--libraries xgrammar,llguidance,outlines-core] [--workdir /tmp/governor-structured-mask-cost]

For each vocabulary size a byte-level BPE tokenizer is trained here (nothing is downloaded) on generated text:
English-like words, a Zipf-distributed lexicon of pseudo-words, identifiers, numbers, JSON and a little non-Latin text,
so the merges look like a real vocabulary's. It is cached in --workdir. The model's vocabulary is the tokenizer's padded
to a multiple of 64, as real checkpoints pad their embeddings. Then, for each library:

- setup: the one-off per-engine cost of turning the tokenizer into the library's vocabulary;
- compile: a typical JSON schema and "any JSON object" (median of --repeats, no cache);
- per token: a fresh matcher walks a valid output token by token, ending on EOS; each step times the fill of the
  next-token bitmask and then the accept of the token (which the fresh mask must allow). --walks fresh matchers each;
  mean, p50, p99 and max over all steps. The first mask of a matcher is included (a request pays it);
- apply: masking [64, vocab] fp32 logits in place with a [64, ceil(vocab/32)] int32 bitmask: each library's CPU
  kernel and Governor's `apply_bitmask`, on one torch thread, median of 20 (CPU time).

Each JSON grammar is measured twice: with no whitespace beyond the fixed separators ", " and ": " (ws=0, what Governor
configures) and with at most 2 whitespace characters between JSON tokens (ws=2). Per-token times are the calling
thread's CPU time (time.thread_time), so other processes on a shared machine do not inflate them; compile and apply
times are wall-clock medians.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
SCHEMA_OUTPUT = json.dumps({
    "name": "Ada Lovelace, Countess of Lovelace", "age": 36, "email": "ada.lovelace@analytical-engine.example.org",
    "role": "admin", "score": 97.25, "active": True,
    "tags": ["mathematics", "analytical engine", "poetry", "notes on the engine", "Bernoulli numbers", "1843"]})
OBJECT_OUTPUT = json.dumps({
    "id": 7, "title": "Quarterly report for the north region", "currency": "EUR",
    "items": [{"sku": "A-113", "name": "Steel bolts, M8", "qty": 200, "price": 0.12},
              {"sku": "B-7", "name": "Hydraulic pump", "qty": 1, "price": 1250.5, "tags": ["urgent", "spare"]}],
    "shipping": {"method": "ground", "address": {"city": "Lyon", "zip": "69001"}, "insured": True},
    "note": None, "paid": False})
WHITESPACE = (0, 2)  # Governor's setting (none beyond fixed separators) and a bounded alternative
EOS = "<|end_of_text|>"
SPECIALS = ("<|begin_of_text|>", EOS, "<|pad|>")


# --- the tokenizer -----------------------------------------------------------------------------------------------

_SYLLABLE_TEXT = """
ba be bi bo bu ca ce co da de di do fa fe fi ga ge go ha he hi ho ka ke ki ko la le li lo lu ma me mi mo mu na ne ni no
pa pe pi po ra re ri ro ru sa se si so ta te ti to tu va ve vi wa we ya zo an en in on un ar er ir or ur al el il ol ter
der ver ber ing tion ment ness able ous ful less ist ism ly est str pr tr cl bl gr sh ch th qu
"""
_WORD_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had by word but what
some we can out other were all there when up use your how said an each she which do their time if will way about many
then them write would like so these her long make thing see him two has look more day could go come did number sound no
most people my over know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very through just form
sentence great think say help low line request token cache memory latency engine queue batch kernel prompt answer server
model value list
"""
_NON_LATIN_TEXT = "café naïve über straße façade smörgåsbord déjà vu 東京 北京 数据 模型 服务 Привет данные модель سلام"
_SYLLABLES, _WORDS, _NON_LATIN = _SYLLABLE_TEXT.split(), _WORD_TEXT.split(), _NON_LATIN_TEXT.split()


def _corpus(seed: int, n_docs: int) -> list[str]:
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice(_SYLLABLES) for _ in range(1 + int(rng.random() * 4))) for _ in range(400_000)]
    # Zipf weights make some pseudo-words frequent enough to become single tokens, as real words do.
    weights = [1.0 / (i + 10) for i in range(len(lexicon))]
    picks = iter(rng.choices(lexicon, weights=weights, k=n_docs * 60))
    docs = []
    for _ in range(n_docs):
        r = rng.random()
        if r < 0.5:
            words = [rng.choice(_WORDS) if rng.random() < 0.4 else next(picks) for _ in range(40)]
            docs.append(" ".join(w.capitalize() if rng.random() < 0.1 else w for w in words) + ".\n")
        elif r < 0.7:
            obj = {next(picks): rng.choice([next(picks), rng.randint(0, 10**rng.randint(1, 6)), rng.random() < 0.5,
                                           None, [next(picks) for _ in range(3)]]) for _ in range(6)}
            docs.append(json.dumps(obj, indent=rng.choice([None, 2])) + "\n")
        elif r < 0.9:
            names = [next(picks) + "_" + next(picks) for _ in range(4)]
            docs.append(f"def {names[0]}({names[1]}, {names[2]}=None):\n    return {names[3]}[{rng.randint(0, 99)}]"
                        f" + {rng.random():.4f}\n")
        else:
            docs.append(" ".join(rng.choice(_NON_LATIN) for _ in range(20)) + "\n")
    return docs


def build_tokenizer(bpe_size: int, workdir: Path) -> Any:
    """A transformers fast tokenizer: byte-level BPE of `bpe_size` ids, then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = workdir / f"bpe-{bpe_size}.json"
    if not path.exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=bpe_size, min_frequency=2, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(_corpus(seed=bpe_size, n_docs=60_000 if bpe_size <= 40_000 else 250_000),
                                trainer=trainer)
        tok.add_special_tokens(list(SPECIALS))
        workdir.mkdir(parents=True, exist_ok=True)
        tok.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS, bos_token=SPECIALS[0],
                                   pad_token=SPECIALS[2], clean_up_tokenization_spaces=False)


# --- the libraries, behind one shape: setup(tok, vocab) -> ctx; compile(ctx, kind) -> grammar;
#     matcher(ctx, grammar) -> m; fill(m, bitmask); accept(m, token) -> bool; done(m) -> bool -------------------------

class Xgrammar:
    name = "xgrammar"

    def setup(self, tok: Any, vocab: int) -> Any:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        return info

    def compile(self, info: Any, kind: str, ws: int) -> Any:
        compiler = self.xgr.GrammarCompiler(info, cache_enabled=False)
        schema = SCHEMA if kind == "schema" else {"type": "object"}
        if ws == 0:
            return compiler.compile_json_schema(schema, any_whitespace=False)
        return compiler.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=ws)

    def matcher(self, info: Any, grammar: Any) -> Any:
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, m: Any, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))

    def done(self, m: Any) -> bool:
        return bool(m.is_terminated())

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        import xgrammar
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)


class Llguidance:
    name = "llguidance"

    def setup(self, tok: Any, vocab: int) -> Any:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        return llguidance.hf.from_tokenizer(tok, n_vocab=vocab)

    def compile(self, lltok: Any, kind: str, ws: int) -> Any:
        options: Any = ({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
                         if ws == 0 else {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{ws}}}"})
        schema = SCHEMA if kind == "schema" else {"type": "object"}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        # llguidance compiles when a matcher is made: that is the compile a request pays.
        m = self.llg.LLMatcher(lltok, grammar)
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, lltok: Any, grammar: Any) -> Any:
        return self.llg.LLMatcher(lltok, grammar)

    def fill(self, m: Any, bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask(m, bitmask, 0)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))

    def done(self, m: Any) -> bool:
        return bool(m.is_stopped())

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        import llguidance.torch
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)


def _byte_decoder() -> dict[str, int]:
    # The byte-level alphabet: printable bytes stand for themselves, the rest are shifted to code points 256+.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class OutlinesCore:
    name = "outlines-core"

    def setup(self, tok: Any, vocab: int) -> Any:
        import outlines_core
        self.oc = outlines_core
        decode = _byte_decoder()
        special = set(tok.all_special_tokens)
        tokens: dict[bytes, list[int]] = {}
        for text, idx in tok.get_vocab().items():
            if text not in special:
                tokens.setdefault(bytes(decode[c] for c in text), []).append(idx)
        self.eos = tok.eos_token_id
        return outlines_core.Vocabulary(tok.eos_token_id, tokens)

    def compile(self, vocabulary: Any, kind: str, ws: int) -> Any:
        schema = SCHEMA if kind == "schema" else {"type": "object"}
        # The separators' one space is part of the pattern here: outlines has no fixed separators.
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), f"[ \\n]{{0,{max(ws, 1)}}}")
        return self.oc.Index(regex, vocabulary)

    def matcher(self, vocabulary: Any, index: Any) -> Any:
        return self.oc.Guide(index)

    def fill(self, g: Any, bitmask: torch.Tensor) -> None:
        row = bitmask[0]
        g.write_mask_into(row.data_ptr(), row.numel(), 4)

    def accept(self, g: Any, token: int) -> bool:
        if token == self.eos and g.is_finished():
            return True  # the guide stays in its final state on EOS rather than advancing
        try:
            g.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def done(self, g: Any) -> bool:
        return bool(g.is_finished())

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        from outlines_core.kernels.torch import apply_token_bitmask_inplace
        apply_token_bitmask_inplace(logits, bitmask)


LIBRARIES = {lib.name: lib for lib in (Xgrammar, Llguidance, OutlinesCore)}


# --- measuring ---------------------------------------------------------------------------------------------------

def median_s(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def walk(lib: Any, ctx: Any, grammar: Any, tokens: list[int], vocab: int) -> tuple[list[float], list[float]]:
    """Fill and accept times (s) of one fresh matcher over `tokens`; checks every mask allows the next token."""
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    m = lib.matcher(ctx, grammar)
    fills, accepts = [], []
    for token in tokens:
        t0 = time.thread_time()
        lib.fill(m, bitmask)
        t1 = time.thread_time()
        ok = lib.accept(m, token)
        t2 = time.thread_time()
        allowed = (int(bitmask[0, token // 32]) >> (token % 32)) & 1
        assert ok and allowed, f"{lib.name} refused token {token} (allowed in mask: {bool(allowed)})"
        fills.append(t1 - t0)
        accepts.append(t2 - t1)
    assert lib.done(m), f"{lib.name}: not terminated after EOS"
    return fills, accepts


def us(s: float) -> str:
    return f"{1e6 * s:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default="32000,128000", help="BPE sizes (the special tokens come on top)")
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/governor-structured-mask-cost"))
    ap.add_argument("--apply-only", action="store_true", help="only the apply figures (CPU, and CUDA when present)")
    args = ap.parse_args()
    if args.apply_only:
        for bpe_size in (int(v) for v in args.vocab.split(",")):
            vocab = -(-(bpe_size + len(SPECIALS)) // 64) * 64
            measure_apply(args.libraries.split(","), vocab)
            if torch.cuda.is_available():
                measure_apply_cuda(vocab)
        return
    print(f"torch threads: {torch.get_num_threads()}; per-token times in us of thread CPU time")
    for bpe_size in (int(v) for v in args.vocab.split(",")):
        t = time.perf_counter()
        tok = build_tokenizer(bpe_size, args.workdir)
        vocab = -(-len(tok) // 64) * 64
        print(f"\n== vocabulary: {len(tok)} tokens, model vocab {vocab} "
              f"(tokenizer ready in {time.perf_counter() - t:.1f} s)")
        outputs = {kind: [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
                   for kind, text in (("schema", SCHEMA_OUTPUT), ("object", OBJECT_OUTPUT))}
        print(f"walks: schema output {len(outputs['schema'])} tokens, object output {len(outputs['object'])} tokens")
        for name in args.libraries.split(","):
            lib = LIBRARIES[name]()
            t = time.perf_counter()
            ctx = lib.setup(tok, vocab)
            print(f"-- {name}: setup {(time.perf_counter() - t) * 1e3:.0f} ms")
            for ws in (WHITESPACE if name != "outlines-core" else WHITESPACE[1:]):
                for kind in ("schema", "object"):
                    measure_grammar(lib, ctx, kind, ws, outputs[kind], vocab, args.walks, args.repeats)
        measure_apply(args.libraries.split(","), vocab)
        if torch.cuda.is_available():
            measure_apply_cuda(vocab)


def measure_grammar(lib: Any, ctx: Any, kind: str, ws: int, tokens: list[int], vocab: int, walks: int,
                    repeats: int) -> None:
    t = time.perf_counter()
    grammar = lib.compile(ctx, kind, ws)
    first_s = time.perf_counter() - t
    # A compile of seconds is reported once: repeating it says nothing new.
    compile_s = median_s(lambda: lib.compile(ctx, kind, ws), repeats) if first_s < 2 else first_s
    fills: list[float] = []
    accepts: list[float] = []
    try:
        for _ in range(walks):
            f, a = walk(lib, ctx, grammar, tokens, vocab)
            fills += f
            accepts += a
    except AssertionError as e:  # a library that cannot express the output is a finding, not a crash
        print(f"   ws={ws} {kind:6s} compile {compile_s * 1e3:8.1f} ms | walk failed: {e}")
        return
    print(f"   ws={ws} {kind:6s} compile {compile_s * 1e3:8.1f} ms (first {first_s * 1e3:.1f})"
          f" | fill: mean {us(statistics.mean(fills))} p50 {us(pct(fills, 0.5))} p99 {us(pct(fills, 0.99))}"
          f" max {us(max(fills))} | accept: mean {us(statistics.mean(accepts))} p99 {us(pct(accepts, 0.99))}")


def measure_apply(names: list[str], vocab: int) -> None:
    from governor.engine.structured import apply_bitmask

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (64, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    kernels: list[tuple[str, Callable[[torch.Tensor, torch.Tensor], None]]] = [("governor", apply_bitmask)]
    kernels += [(name, LIBRARIES[name]().apply) for name in names]
    threads = torch.get_num_threads()
    # One thread, so the calling thread's CPU time is the whole cost, whatever else the machine runs.
    torch.set_num_threads(1)
    for name, apply in kernels:
        try:
            apply(logits.clone(), bitmask)  # a first call may compile
            apply_s = median_s(functools.partial(apply, logits, bitmask), 20, clock=time.thread_time)
            print(f"-- apply [64, {vocab}] fp32, {name}: {apply_s * 1e3:.2f} ms")
        except Exception as e:  # a library kernel that cannot run here is reported, not fatal
            print(f"-- apply [64, {vocab}] fp32, {name}: failed: {type(e).__name__}: {str(e)[:200]}")
    torch.set_num_threads(threads)


def measure_apply_cuda(vocab: int) -> None:
    """[64, vocab] fp32 and bf16 logits on the GPU: Governor's apply_bitmask with the bitmask already there and with
    it in pinned host memory (the copy included), and xgrammar's Triton kernel; mean of 200 in CUDA events. Each
    result is checked against the CPU's."""
    from governor.engine.structured import apply_bitmask

    gen = torch.Generator().manual_seed(0)
    host_mask = torch.randint(-2**31, 2**31 - 1, (64, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    pinned = host_mask.pin_memory()
    for dtype in (torch.float32, torch.bfloat16):
        cpu = torch.randn(64, vocab, generator=gen).to(dtype)
        want = cpu.clone()
        apply_bitmask(want, host_mask)
        kernels: list[tuple[str, Callable[[torch.Tensor], None]]] = [
            ("governor, bitmask on GPU", functools.partial(_flip(apply_bitmask), host_mask.cuda())),
            ("governor, pinned host bitmask", functools.partial(_flip(apply_bitmask), pinned))]
        try:
            import xgrammar
            kernels.append(("xgrammar Triton", functools.partial(_flip(xgrammar.apply_token_bitmask_inplace),
                                                                 host_mask.cuda())))
        except ImportError:
            pass
        for name, apply in kernels:
            logits = cpu.cuda()
            apply(logits)
            assert torch.equal(logits.cpu(), want), f"{name} differs from the CPU on {dtype}"
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(200):
                apply(logits)
            end.record()
            end.synchronize()
            print(f"-- apply [64, {vocab}] {str(dtype).removeprefix('torch.')} on {torch.cuda.get_device_name()}, "
                  f"{name}: {start.elapsed_time(end) / 200 * 1e3:.1f} us")


def _flip(apply: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    return lambda bitmask, logits: apply(logits, bitmask)


if __name__ == "__main__":
    main()
