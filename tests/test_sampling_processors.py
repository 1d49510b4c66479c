"""Per-request logits processing: presence, frequency and repetition penalties, logit bias, min_tokens, stop strings
kept in the output, and structured outputs; on hand-made logits against plain-PyTorch references, and through the
engine (fp32, CPU) in every path that samples: the plain step, async scheduling and speculative decoding."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from governor.engine import LLM, SamplingParams
from governor.engine.bench.latency import bench_latency
from governor.engine.bench.throughput import BENCH_JSON_SCHEMA, RequestOptions, Workload, run_engine
from governor.engine.llm_engine import LLMEngine
from governor.engine.logits_processing import LogitsProcessor, needs_processing, output_counts, process_logits
from governor.engine.models.tokenizer_builder import EOS_ID
from governor.engine.sampler import argmax_only, sample
from governor.engine.sampling_params import StructuredOutputsParams
from tests.conftest import count_calls
from tests.test_engine_parity import greedy, mixed_prompts

EOS = 1  # the tiny checkpoints' eos_token_id (tests/conftest.py)
NEG_INF = float("-inf")


# --- references, written out token by token ---------------------------------------------------

def reference_processing(row: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                         stop_ids: list[int]) -> torch.Tensor:
    """One row of logits after logit_bias, the min_tokens mask and the penalties, one token at a time."""
    x = row.clone()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    if len(output) < params.min_tokens:
        for token in stop_ids:
            x[token] = NEG_INF
    r = params.repetition_penalty
    for token in set(prompt) | set(output):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def processor(params: SamplingParams, prompt: list[int], output: list[int],
              stop_ids: list[int] | tuple[()] = ()) -> LogitsProcessor:
    return LogitsProcessor(params, prompt, output, stop_ids)


def tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# --- the processing on hand-made logits -------------------------------------------------------

def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0, 0.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    prompt, output = [0, 5, 5], [1, 1, 1, 2, 4]
    out = process_logits(logits, [processor(params, prompt, output)])
    # token 1: 3 times, 2: once, 4: once; 0 and 5 are in the prompt only, 3 nowhere
    assert out[0].tolist() == [1.0, 2.0 - 0.5 - 0.75, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 0.5 - 0.25, 0.0]


def test_repetition_penalty_shrinks_logits_of_prompt_and_output_tokens_toward_less_likely() -> None:
    logits = torch.tensor([[2.0, -2.0, 4.0, -4.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0)
    out = process_logits(logits, [processor(params, [0, 1], [2, 3, 3])])
    assert out[0].tolist() == [1.0, -4.0, 2.0, -8.0, 1.0]


def test_logit_bias_is_added_to_its_tokens() -> None:
    logits = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])
    params = SamplingParams(logit_bias={0: -100.0, 2: 7.5})
    out = process_logits(logits, [processor(params, [1], []), None])
    assert out.tolist() == [[-99.5, 0.5, 8.0], [1.0, 1.0, 1.0]]


def test_min_tokens_masks_the_stop_tokens_until_the_output_is_long_enough() -> None:
    logits = torch.zeros(1, 6)
    params = SamplingParams(min_tokens=2, stop_token_ids=[4])
    output: list[int] = [3]
    proc = processor(params, [0], output, stop_ids=[4, EOS])
    assert process_logits(logits, [proc])[0].tolist() == [0.0, NEG_INF, 0.0, 0.0, NEG_INF, 0.0]
    output.append(3)  # the processor reads the sequence's own list as it grows
    assert process_logits(logits, [proc])[0].tolist() == [0.0] * 6


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_of_processed_and_plain_rows_matches_the_reference_row_by_row(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab = 40
    logits = torch.randn(5, vocab, generator=g) * 3
    histories = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (0, 3, 9, 14, 6)]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 1, 7, 2, 5)]
    params = [
        SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5, repetition_penalty=1.3, min_tokens=2,
                       logit_bias={3: 2.0, 7: -5.0}),
        SamplingParams(),  # a plain row in the middle of the batch
        SamplingParams(repetition_penalty=0.7, logit_bias={39: 100.0}),
        SamplingParams(frequency_penalty=2.0, max_tokens=32, min_tokens=20, stop_token_ids=[11]),
        SamplingParams(presence_penalty=-2.0),
    ]
    stop_ids = [[EOS], [EOS], [EOS], [11, EOS], [EOS]]
    procs = [None if not needs_processing(p) else processor(p, pr, h, s)
             for p, pr, h, s in zip(params, prompts, histories, stop_ids, strict=True)]
    before = logits.clone()
    out = process_logits(logits, procs)
    assert torch.equal(logits, before)  # the raw logits stay as they were: they give the logprobs
    for i, p in enumerate(params):
        want = reference_processing(logits[i], p, prompts[i], histories[i], stop_ids[i])
        torch.testing.assert_close(out[i], want, rtol=0, atol=1e-5)


def test_output_counts_are_the_bincount_of_each_history() -> None:
    histories = [[5, 5, 1], [], [0, 9, 9, 9, 2]]
    counts = output_counts(histories, 10, torch.device("cpu"))
    assert counts.tolist() == [torch.bincount(torch.tensor(h, dtype=torch.int64), minlength=10).float().tolist()
                               for h in histories]


def test_a_batch_without_processing_is_returned_as_it_is() -> None:
    logits = torch.randn(3, 8)
    assert process_logits(logits, [None, None, None]) is logits


def test_sampling_uses_the_processed_logits_and_reports_the_raw_logprobs() -> None:
    logits = torch.tensor([[4.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, logit_bias={2: 10.0}, logprobs=1),
              SamplingParams(temperature=0.8, seed=1, logit_bias={3: 100.0}, logprobs=0)]
    procs = [processor(p, [0], []) for p in params]
    result = sample(logits, params, [None, torch.Generator().manual_seed(1)], processors=procs)
    assert result.token_ids == [2, 3]
    raw = logits.log_softmax(dim=1)
    assert result.logprobs[0] == pytest.approx({2: raw[0, 2].item(), 0: raw[0, 0].item()})
    assert result.logprobs[1] == pytest.approx({3: raw[1, 3].item()})


def test_only_plain_greedy_requests_without_logprobs_are_argmax_only() -> None:
    assert argmax_only(SamplingParams(temperature=0.0))
    for kwargs in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1},
                   {"logit_bias": {5: 1.0}}, {"min_tokens": 1}):
        params = SamplingParams(temperature=0.0, **kwargs)
        assert needs_processing(params) and not argmax_only(params), kwargs
    # A stop string kept in the output changes stopping, not the logits.
    assert argmax_only(SamplingParams(temperature=0.0, include_stop_str_in_output=True, stop=["x"]))


# --- through the engine ----------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_back_an_overwhelmingly_likely_eos_until_reached(llm: LLM, temperature: float) -> None:
    prompt = mixed_prompts(1, seed=50)[0]
    eos_first = SamplingParams(temperature=temperature, seed=3, max_tokens=20, logit_bias={EOS: 100.0})
    assert tokens(llm.generate([prompt], eos_first)) == [[EOS]]
    held = llm.generate([prompt], SamplingParams(temperature=temperature, seed=3, max_tokens=20, min_tokens=6,
                                                 logit_bias={EOS: 100.0}))[0].outputs[0]
    assert len(held.token_ids) == 7 and EOS not in held.token_ids[:6] and held.token_ids[6] == EOS
    assert (held.finish_reason, held.stop_reason) == ("stop", None)


def test_min_tokens_holds_back_stop_token_ids_too(llm: LLM) -> None:
    prompt = mixed_prompts(1, seed=51)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=3, stop_token_ids=[42],
                                                logit_bias={42: 100.0}, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and 42 not in out.token_ids[:3] and out.token_ids[3] == 42
    assert (out.finish_reason, out.stop_reason) == ("stop", 42)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_a_token(llm: LLM, temperature: float) -> None:
    prompt = mixed_prompts(1, seed=52)[0]
    out = llm.generate([prompt], SamplingParams(temperature=temperature, seed=4, max_tokens=6, ignore_eos=True,
                                                logit_bias={42: 100.0}))[0].outputs[0]
    assert out.token_ids == [42] * 6


def test_logit_bias_outside_the_vocabulary_is_refused_at_admission(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in the model's vocabulary \[0, 2048\); "
                                         r"2048, 5000 are not"):
        llm.generate([[5, 6]], SamplingParams(logit_bias={5000: 1.0, 2048: 1.0, 3: 1.0}))
    assert not llm.engine.has_unfinished_requests()


def test_logprobs_stay_those_of_the_model_when_the_logits_are_processed(llm: LLM) -> None:
    prompt = mixed_prompts(1, seed=53)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=2,
                                                logit_bias={42: 100.0}))[0].outputs[0]
    raw = llm.engine.prompt_logits(prompt)[-1].log_softmax(dim=0)
    top = raw.topk(2)
    assert out.token_ids == [42]
    want = {42: raw[42].item(), **{int(t): v.item() for t, v in zip(top.indices, top.values, strict=True)}}
    assert out.logprobs is not None and out.logprobs[0] == pytest.approx(want, abs=1e-4)


def stream(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[str, Any]:
    """(the concatenated text deltas, the final output) of one request run alone with stream_text."""
    engine.add_request("streamed", prompt, params, stream_text=True)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        result = engine.step()
        deltas += [ev.text_delta for ev in result.events]
        final = next(iter(result.finished), final)
    assert final is not None
    return "".join(deltas), final.outputs[0]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_the_text_before_it_or_after_it_with_include_stop_str_in_output(llm: LLM,
                                                                                          include: bool) -> None:
    prompt = mixed_prompts(1, seed=14)[0]
    text = llm.generate([prompt], greedy(16))[0].outputs[0].text
    stop = text[3:6]
    want = text[:text.find(stop) + (len(stop) if include else 0)]
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=[stop], include_stop_str_in_output=include)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.text == want and (out.finish_reason, out.stop_reason) == ("stop", stop)
    streamed, final = stream(llm.engine, prompt, params)
    assert streamed == final.text == want


def test_stop_strings_in_the_text_of_the_first_min_tokens_tokens_do_not_stop(llm: LLM) -> None:
    prompt = mixed_prompts(1, seed=54)[0]
    free = llm.generate([prompt], greedy(24))[0].outputs[0]
    decode = llm.tokenizer.decode
    k = 4
    protected = decode(free.token_ids[:k])
    # A character of the protected text that occurs again later.
    stop = next(c for c in protected if c.strip() and c in free.text[len(protected):])
    assert free.text.find(stop) < len(protected)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                min_tokens=k))[0].outputs[0]
    assert out.text == free.text[:free.text.find(stop, len(protected))]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == free.token_ids[:len(out.token_ids)] and len(out.token_ids) > k


PENALTIES = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=0.8,
                           frequency_penalty=1.2, repetition_penalty=1.6)


def reference_greedy(engine: LLMEngine, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """n greedy tokens with `reference_processing` applied at each step to the model's logits, recomputed over
    the whole sequence each time (`prompt_logits`, no decode steps)."""
    output: list[int] = []
    for _ in range(n):
        row = engine.prompt_logits(prompt + output)[-1]
        output.append(int(reference_processing(row, params, prompt, output, [EOS]).argmax()))
    return output


def test_penalised_greedy_output_follows_a_step_by_step_reference(llm: LLM) -> None:
    prompt = mixed_prompts(1, seed=58)[0]  # its free output repeats a token: the penalties move off it
    free = tokens(llm.generate([prompt], greedy(16)))[0]
    penalised = tokens(llm.generate([prompt], PENALTIES))[0]
    assert penalised[:7] == free[:7] and penalised[7:] != free[7:]
    assert penalised == reference_greedy(llm.engine, prompt, PENALTIES, 16)


MIXED = [
    greedy(16),
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8),
    greedy(16),
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={42: 6.0, 7: 5.0}),
    SamplingParams(temperature=0.0, max_tokens=16, min_tokens=10, logit_bias={EOS: 9.0}),
    SamplingParams(temperature=0.7, seed=5, max_tokens=16, ignore_eos=True, frequency_penalty=2.0),
]


def mixed_batch_prompts() -> list[list[int]]:
    """Prompts with a repeated phrase (penalties and n-gram drafts both have something to bite on)."""
    prompts = mixed_prompts(len(MIXED), seed=56, lo=4, hi=20)
    return [p + p[:4] + p for p in prompts]


ENGINES: dict[str, dict[str, Any]] = {
    "sync": {"async_scheduling": False},
    "async": {"async_scheduling": True},
    # One step at a time: prompt lookup then runs every step (with async scheduling, a proposer that finds nothing
    # sits out steps, and this random model's outputs repeat only now and then).
    "ngram-drafts": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}, "async_scheduling": False},
}


@pytest.fixture(scope="module")
def engine_with(qwen3: Path) -> Callable[[str], LLM]:
    """`engine_with(setup)` → an engine of one of the ENGINES setups, cached."""
    cache: dict[str, LLM] = {}

    def get(setup: str) -> LLM:
        if setup not in cache:
            cache[setup] = LLM(str(qwen3), dtype="float32", max_model_len=256, **ENGINES[setup])
        return cache[setup]

    return get


@pytest.fixture(scope="module")
def alone(llm: LLM) -> list[list[int]]:
    """Each MIXED request's tokens, run on its own through a plain engine."""
    return [tokens(llm.generate([p], params))[0] for p, params in zip(mixed_batch_prompts(), MIXED, strict=True)]


@pytest.mark.parametrize("setup", ENGINES)
def test_a_batch_of_processed_and_plain_requests_gives_each_its_tokens_alone(engine_with: Callable[[str], LLM],
                                                                            alone: list[list[int]],
                                                                            setup: str) -> None:
    engine = engine_with(setup)
    assert tokens(engine.generate(mixed_batch_prompts(), MIXED)) == alone
    assert engine.stats()["kv_blocks_used"] == 0


def test_plain_greedy_requests_keep_the_argmax_path_and_a_processed_one_leaves_it(
        llm: LLM, sample_calls: dict[str, int]) -> None:
    calls = sample_calls
    prompts = mixed_prompts(4, seed=57)
    plain = tokens(llm.generate(prompts, greedy(10)))
    assert calls["sample"] == 0
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, greedy(10))
    engine.add_request("penalised", prompts[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                                repetition_penalty=1.5))
    assert engine._num_not_argmax == 1
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            outs[o.request_id] = o.outputs[0].token_ids
    assert calls["sample"] > 0 and engine._num_not_argmax == 0
    assert [outs[f"p{i}"] for i in range(4)] == plain


def test_async_scheduling_takes_no_argmax_step_while_a_processed_request_is_live(
        engine_with: Callable[[str], LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    llm = engine_with("async")
    launched = count_calls(monkeypatch, llm.engine, "_launched")
    prompts = mixed_prompts(3, seed=58)
    llm.generate(prompts, greedy(8))
    assert launched["_launched"] > 0  # plain greedy requests do take the argmax steps
    launched["_launched"] = 0
    llm.generate(prompts, [greedy(8), greedy(8), SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4)])
    assert launched["_launched"] == 0


def test_requests_with_processing_get_no_drafts_and_the_tokens_of_plain_decoding(
        engine_with: Callable[[str], LLM], alone: list[list[int]]) -> None:
    llm = engine_with("ngram-drafts")
    before = llm.stats()["spec_proposed_tokens"]
    prompts = mixed_batch_prompts()
    processed = [i for i, p in enumerate(MIXED) if needs_processing(p)]
    assert tokens(llm.generate([prompts[i] for i in processed], [MIXED[i] for i in processed])) == [
        alone[i] for i in processed]
    assert llm.stats()["spec_proposed_tokens"] == before
    assert tokens(llm.generate([prompts[0]], MIXED[0])) == [alone[0]]
    assert llm.stats()["spec_proposed_tokens"] > before  # the same engine still drafts for a plain request


def test_prompt_tokens_count_for_the_repetition_penalty_only(llm: LLM) -> None:
    """A logit bias lifts a prompt token to the top: the repetition penalty (prompt and output tokens) takes it
    back down, presence and frequency penalties (output tokens only) leave it there."""
    prompt = mixed_prompts(1, seed=59)[0]
    logits = llm.engine.prompt_logits(prompt)[-1]
    token = max(prompt, key=lambda t: logits[t].item())
    bias = {token: round(logits.max().item() - logits[token].item() + 1.0, 3)}
    assert logits.max().item() > 0 and bias[token] <= 100
    lifted = SamplingParams(temperature=0.0, max_tokens=1, logit_bias=bias)
    assert tokens(llm.generate([prompt], lifted))[0] == [token]
    output_only = SamplingParams(temperature=0.0, max_tokens=1, logit_bias=bias, presence_penalty=2.0,
                                 frequency_penalty=2.0)
    assert tokens(llm.generate([prompt], output_only))[0] == [token]
    repetition = SamplingParams(temperature=0.0, max_tokens=1, logit_bias=bias, repetition_penalty=2.0)
    want = int(reference_processing(logits, repetition, prompt, [], [EOS]).argmax())
    assert want != token and tokens(llm.generate([prompt], repetition))[0] == [want]


# --- structured outputs ----------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def eos_special(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """The tiny checkpoint with the tokenizer's <|end_of_text|> as its EOS, as real models have a special EOS (the
    conftest checkpoints' EOS, id 1, is the byte token of '"')."""
    ckpt = tmp_path_factory.mktemp("eos-special") / "qwen3"
    shutil.copytree(qwen3, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["eos_token_id"] = EOS_ID
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    return LLM(str(ckpt), dtype="float32", max_model_len=256)


def structured(temperature: float, seed: int, skip_special_tokens: bool = False) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=100, skip_special_tokens=skip_special_tokens,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))


def test_structured_json_output_parses_and_validates_against_its_schema(eos_special: LLM) -> None:
    prompts = mixed_prompts(4, seed=62)
    unconstrained = eos_special.generate(prompts, [SamplingParams(temperature=1.0, seed=i, max_tokens=30)
                                                   for i in range(4)])
    for o in unconstrained:  # the random model writes no JSON by itself
        with pytest.raises(json.JSONDecodeError):
            json.loads(o.outputs[0].text)
    # Beside a plain request, so their rows are masked within a larger batch; special tokens kept in the text of
    # half of them (the EOS that ends the grammar must stay out of it either way).
    params = [structured(1.0, seed=i, skip_special_tokens=i % 2 == 1) for i in range(4)]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=20))
    outs = eos_special.generate(prompts + mixed_prompts(1, seed=63), params)
    for o in outs[:4]:
        c = o.outputs[0]
        jsonschema.validate(json.loads(c.text), SCHEMA)
        # The grammar ended on EOS: the request stops there, and the EOS stays out of the text.
        assert (c.finish_reason, c.stop_reason) == ("stop", None) and c.token_ids[-1] == EOS_ID
        assert "<|end_of_text|>" not in c.text
    assert eos_special.stats()["kv_blocks_used"] == 0


def test_a_greedy_structured_request_in_a_batch_leaves_the_others_their_tokens(eos_special: LLM) -> None:
    prompts = mixed_prompts(3, seed=64)
    plain = tokens(eos_special.generate(prompts[1:], greedy(12)))
    alone = eos_special.generate([prompts[0]], structured(0.0, seed=0))[0].outputs[0]
    outs = eos_special.generate(prompts, [structured(0.0, seed=0), greedy(12), greedy(12)])
    assert outs[0].outputs[0].token_ids == alone.token_ids and tokens(outs[1:]) == plain
    jsonschema.validate(json.loads(alone.text), SCHEMA)


def test_structured_requests_get_no_drafts(eos_special: LLM) -> None:
    prompts = mixed_batch_prompts()[:3]
    want = tokens(eos_special.generate(prompts, structured(0.0, seed=0)))
    spec = LLM(eos_special.engine.config.model, dtype="float32", max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert tokens(spec.generate(prompts, structured(0.0, seed=0))) == want
    assert spec.stats()["spec_proposed_tokens"] == 0


def test_the_grammar_decides_the_end_even_before_min_tokens(eos_special: LLM) -> None:
    """min_tokens masks no EOS a grammar needs: a choice ends once written, with fewer tokens than min_tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=15,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = eos_special.generate([mixed_prompts(1, seed=65)[0]], params)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and out.token_ids[-1] == EOS_ID
    assert len(out.token_ids) < 15


def test_an_invalid_structured_output_is_a_value_error_at_admission(eos_special: LLM) -> None:
    engine = eos_special.engine
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError):
        engine.add_request("bad-regex", [5, 6, 7], bad)
    assert not engine.has_unfinished_requests() and "bad-regex" not in engine._requests


def test_a_token_the_grammar_refuses_aborts_the_request(eos_special: LLM) -> None:
    """The mask keeps refused tokens from being drawn; should one come anyway, the request ends with "abort"
    rather than go on outside its grammar."""
    engine = eos_special.engine
    engine.add_request("refused", [5, 6, 7], structured(0.0, seed=0))
    req = engine._requests["refused"]
    assert req.grammar is not None
    x = eos_special.tokenizer.convert_tokens_to_ids("x")
    assert req.append(x, None) == "abort"  # a JSON object cannot start with "x"
    engine.abort("refused")


# --- the benchmarks' request options ---------------------------------------------------------

def test_the_benchmarks_run_with_penalties_and_structured_outputs(eos_special: LLM) -> None:
    options = RequestOptions(penalties=True, structured="json")
    params = options.params(7)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, 0.5, 1.1)
    assert params.structured_outputs == StructuredOutputsParams(json=BENCH_JSON_SCHEMA)
    model = eos_special.engine.config.model
    latency = bench_latency(model, {"dtype": "float32", "device": "cpu", "max_model_len": 64}, 8, [1, 3], 6,
                            options=options)
    assert latency["engine"]["requests"] == {"penalties": True, "structured": "json"}
    assert [(r["batch"], r["decode_steps"]) for r in latency["rows"]] == [(1, 5), (3, 5)]
    throughput = run_engine(model, Workload(3, (4, 8), (5, 5)), {"dtype": "float32", "device": "cpu"}, options)
    assert throughput["requests"] == {"penalties": True, "structured": "json"}
    assert throughput["generated_tokens"] == 15  # 5 tokens each: too few for an object to end
    with pytest.raises(ValueError, match="structured must be one of json"):
        RequestOptions(structured="yaml")
