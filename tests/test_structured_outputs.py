"""Structured outputs: every mask keeps a sampler inside the requested language, and the output ends on EOS.

A random "model" walks each grammar: it samples uniformly among the tokens the mask allows, ends on EOS once the output
is long enough, and after a step budget prefers closing tokens so every walk ends within a few hundred steps.
"""

from __future__ import annotations

import ast
import json
import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from governor.engine import structured as structured_module
from governor.engine.models.tokenizer_builder import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    PAD_ID,
    VOCAB_SIZE,
    write_tokenizer,
)
from governor.engine.sampling_params import StructuredOutputsParams as Params
from governor.engine.structured import GrammarState, StructuredOutputs, allocate_bitmask, apply_bitmask
from governor.engine.tokenizer import load_tokenizer

MODEL_VOCAB = VOCAB_SIZE + 48  # the logits are wider than the tokenizer, as in real checkpoints
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,4}(\.[a-z]{1,3})?"
CHOICES = ["yes", "no", "maybe not", 'a "quoted" \\ answer']
# Nested lists of positive integers: a context-free language, and valid JSON, so json.loads checks it.
GRAMMAR = r"""
root ::= list
list ::= "[" (elem ("," elem)*)? "]"
elem ::= [1-9] [0-9]* | list
"""
CLOSERS = ('"', "]", "}")
SEEDS = range(6)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path, 512)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def structured(tokenizer: Any) -> StructuredOutputs:
    return StructuredOutputs(tokenizer, MODEL_VOCAB)


@pytest.fixture(scope="module")
def texts(tokenizer: Any) -> list[str]:
    return [tokenizer.decode([t]) for t in range(len(tokenizer))]


def allowed_tokens(bitmask: torch.Tensor, row: int = 0) -> list[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:MODEL_VOCAB].nonzero().flatten().tolist()


def random_walk(state: GrammarState, texts: list[str], rng: random.Random, min_tokens: int = 6,
                budget: int = 60, max_steps: int = 300) -> list[int]:
    """Sample among allowed tokens until EOS; returns the output's tokens (EOS excluded). Checks every mask."""
    bitmask = allocate_bitmask(1, MODEL_VOCAB)
    out: list[int] = []
    for _ in range(max_steps):
        state.fill_mask(bitmask, 0)
        allowed = allowed_tokens(bitmask)
        assert allowed, f"no token allowed after {out}"
        assert max(allowed) < VOCAB_SIZE, "a padding id of the logits was allowed"
        assert not {BOS_ID, IM_START_ID, IM_END_ID, PAD_ID} & set(allowed), "a special token was allowed"
        if EOS_ID in allowed and (len(out) >= min_tokens or allowed == [EOS_ID]):
            assert state.accept(EOS_ID)
            assert state.is_terminated()
            return out
        choices = [t for t in allowed if t != EOS_ID]
        if len(out) >= budget:
            choices = [t for t in choices if texts[t] in CLOSERS] or choices
        token = rng.choice(choices)
        assert state.accept(token), f"the mask allowed {token} ({texts[token]!r}) but accept refused it"
        assert not state.is_terminated()
        out.append(token)
    raise AssertionError(f"no EOS within {max_steps} steps: {out}")


@pytest.fixture(scope="module")
def walk_text(structured: StructuredOutputs, tokenizer: Any, texts: list[str]) -> Callable[[Params, int], str]:
    """The decoded output of one seeded random walk of a fresh matcher for `params`."""

    def walk(params: Params, seed: int) -> str:
        return str(tokenizer.decode(random_walk(structured.matcher(params), texts, random.Random(seed))))

    return walk


# --- each kind's walks give valid outputs ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_walks_give_documents_valid_against_the_schema(walk_text, seed) -> None:
    text = walk_text(Params(json=SCHEMA), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_schema_given_as_a_json_string_constrains_the_same_way(walk_text) -> None:
    text = walk_text(Params(json=json.dumps(SCHEMA)), 11)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_walks_give_json_objects(walk_text, seed) -> None:
    text = walk_text(Params(json_object=True), seed)
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_walks_give_full_matches(walk_text, seed) -> None:
    text = walk_text(Params(regex=REGEX), seed)
    assert re.fullmatch(REGEX, text), text


def test_choice_walks_give_exactly_one_of_the_strings(walk_text) -> None:
    outputs = {walk_text(Params(choice=CHOICES), seed) for seed in range(20)}
    assert outputs <= set(CHOICES)
    assert len(outputs) >= 3, outputs  # the walk is random, so several choices come out


@pytest.mark.parametrize("seed", SEEDS)
def test_ebnf_grammar_walks_give_sentences_of_the_grammar(walk_text, seed) -> None:
    text = walk_text(Params(grammar=GRAMMAR), seed)

    def nested_positive_ints(value: Any) -> bool:
        if isinstance(value, list):
            return all(nested_positive_ints(v) for v in value)
        return isinstance(value, int) and value > 0

    assert re.fullmatch(r"[\[\],0-9]+", text) and nested_positive_ints(json.loads(text)), text


# --- what the masks refuse -------------------------------------------------------------------------------------------

def test_a_disallowed_token_is_refused_and_leaves_the_state_unchanged(structured, tokenizer) -> None:
    state = structured.matcher(Params(choice=["yes", "no"]))
    x = tokenizer.convert_tokens_to_ids("x")
    assert state.accept(x) is False
    assert state.accept(EOS_ID) is False  # nothing was output yet
    for token in tokenizer.encode("no", add_special_tokens=False):
        assert state.accept(token)
    assert state.accept(EOS_ID) and state.is_terminated()


def test_special_tokens_are_refused_even_inside_a_json_string(structured, tokenizer) -> None:
    state = structured.matcher(Params(json_object=True))
    for token in tokenizer.encode('{"a": "', add_special_tokens=False):
        assert state.accept(token)
    bitmask = allocate_bitmask(1, MODEL_VOCAB)
    state.fill_mask(bitmask, 0)
    allowed = set(allowed_tokens(bitmask))
    assert tokenizer.convert_tokens_to_ids("x") in allowed
    assert not {BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID} & allowed
    assert state.accept(IM_END_ID) is False


def test_json_whitespace_is_bounded_to_the_separators(structured, tokenizer, texts) -> None:
    state = structured.matcher(Params(json_object=True))
    bitmask = allocate_bitmask(1, MODEL_VOCAB)

    def whitespace_allowed() -> set[str]:
        state.fill_mask(bitmask, 0)
        return {texts[t] for t in allowed_tokens(bitmask) if t < len(texts) and texts[t] and texts[t].isspace()}

    assert whitespace_allowed() == set()  # before the object
    assert state.accept(tokenizer.convert_tokens_to_ids("{"))
    assert whitespace_allowed() == set()
    for token in tokenizer.encode('"a":', add_special_tokens=False):
        assert state.accept(token)
    assert whitespace_allowed() == {" "}  # the separator's one space, nothing longer
    assert state.accept(tokenizer.convert_tokens_to_ids("Ġ"))
    assert whitespace_allowed() == set()


def test_once_the_structure_is_complete_only_eos_is_allowed_and_then_nothing(structured, tokenizer) -> None:
    state = structured.matcher(Params(regex="ab"))
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert state.accept(token)
    bitmask = allocate_bitmask(1, MODEL_VOCAB)
    state.fill_mask(bitmask, 0)
    assert allowed_tokens(bitmask) == [EOS_ID]
    assert not state.is_terminated()
    assert state.accept(EOS_ID) and state.is_terminated()
    assert state.accept(tokenizer.convert_tokens_to_ids("a")) is False
    bitmask.fill_(0)
    state.fill_mask(bitmask, 0)  # a caller a step behind still gets a mask: EOS alone
    assert allowed_tokens(bitmask) == [EOS_ID]


def test_stop_tokens_can_be_given_instead_of_the_tokenizers_eos(tokenizer) -> None:
    structured = StructuredOutputs(tokenizer, MODEL_VOCAB, stop_token_ids=[IM_END_ID])
    state = structured.matcher(Params(regex="ok"))
    for token in tokenizer.encode("ok", add_special_tokens=False):
        assert state.accept(token)
    bitmask = allocate_bitmask(1, MODEL_VOCAB)
    state.fill_mask(bitmask, 0)
    assert allowed_tokens(bitmask) == [IM_END_ID]


# --- masks on logits -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_applied_masks_put_minus_inf_exactly_where_bits_are_zero(structured, tokenizer, dtype) -> None:
    # Rows from different requests and positions: a schema's start, inside a string, a regex, and a row left full.
    states = [structured.matcher(Params(json=SCHEMA)), structured.matcher(Params(json_object=True)),
              structured.matcher(Params(regex=REGEX))]
    for token in tokenizer.encode('{"k": "v', add_special_tokens=False):
        assert states[1].accept(token)
    bitmask = allocate_bitmask(4, MODEL_VOCAB)
    for row, state in enumerate(states):
        state.fill_mask(bitmask, row)
    logits = torch.randn(4, MODEL_VOCAB, generator=torch.Generator().manual_seed(0)).to(dtype)
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    for row in range(4):
        allowed = torch.zeros(MODEL_VOCAB, dtype=torch.bool)
        allowed[allowed_tokens(bitmask, row)] = True
        assert torch.equal(masked[row].isneginf(), ~allowed)
        assert torch.equal(masked[row][allowed], logits[row][allowed])
    assert not masked[3].isinf().any()  # allocate_bitmask starts every row full


def test_apply_bitmask_matches_the_bit_layout_on_random_masks() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 1000  # not a multiple of 32: the last word's high bits lie past the logits
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    apply_bitmask(logits, bitmask)
    for row in range(3):
        want = [(int(bitmask[row, t // 32]) >> (t % 32)) & 1 == 0 for t in range(vocab)]
        assert logits[row].isneginf().tolist() == want


def test_apply_bitmask_refuses_a_bitmask_narrower_than_the_logits() -> None:
    with pytest.raises(ValueError, match="covers 64 tokens, fewer than the logits' 65"):
        apply_bitmask(torch.zeros(1, 65), torch.zeros(1, 2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_on_cuda_logits_with_a_host_bitmask(dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    bitmask = torch.randint(-2**31, 2**31 - 1, (64, 4002), dtype=torch.int32, generator=gen)
    logits = torch.randn(64, 128_064, generator=gen).to(dtype)
    on_gpu = logits.cuda()
    apply_bitmask(on_gpu, bitmask)
    apply_bitmask(logits, bitmask)
    assert torch.equal(on_gpu.cpu(), logits)


# --- compiling -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("params", "message"), [
    (Params(json='{"type": "object",'), r"invalid JSON schema: it is not JSON"),
    (Params(json={"type": "foo"}), r'invalid JSON schema: .*Unsupported type "foo"'),
    (Params(json={"type": "integer", "minimum": 5, "maximum": 1}), r"invalid JSON schema: .*minimum greater"),
    (Params(regex="a(b"), r"invalid regex: .*parenthesis is not closed"),
    (Params(grammar='root ::= "a" | missing'), r'invalid EBNF grammar .*Rule "missing" is not defined'),
    (Params(grammar='start ::= "a"'), r'invalid EBNF grammar .*root rule with name "root" is not found'),
])
def test_compile_errors_are_value_errors_naming_the_problem(structured, params, message) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        structured.compile(params)
    assert "/project/cpp" not in str(raised.value)  # no C++ source locations in what a user reads


def test_compile_is_cached_by_content(structured) -> None:
    assert structured.compile(Params(json=SCHEMA)) is structured.compile(Params(json=json.loads(json.dumps(SCHEMA))))
    assert structured.compile(Params(json=SCHEMA)) is structured.compile(Params(json=json.dumps(SCHEMA, indent=2)))
    assert structured.compile(Params(regex=REGEX)) is structured.compile(Params(regex=REGEX))
    assert structured.compile(Params(choice=["a", "b"])) is not structured.compile(Params(choice=["b", "a"]))
    assert structured.compile(Params(regex="a")) is not structured.compile(Params(grammar='root ::= "a"'))


def test_concurrent_compiles_of_one_content_compile_once(structured, monkeypatch) -> None:
    import governor.engine.structured.structured_outputs as module

    calls = []
    real = module.compile_language

    def slow_compile(compiler: Any, key: Any) -> Any:
        calls.append(key)
        time.sleep(0.05)  # long enough that every thread asks while the first compile runs
        return real(compiler, key)

    monkeypatch.setattr(module, "compile_language", slow_compile)
    params = Params(regex="[0-9]{3}-only-once")
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(structured.compile(params))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(results) == 8 and all(r is results[0] for r in results)


def test_the_grammar_library_is_imported_only_inside_functions() -> None:
    # An engine that never sees a structured request starts without xgrammar: no module-level import of it.
    package = Path(structured_module.__file__).parent
    for path in sorted(package.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "xgrammar" for n in names), f"{path.name}:{node.lineno}"
