"""Engine behaviour: invariance, block accounting, sampling, stopping and input validation (fp32, CPU)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from governor import contract
from governor.engine import LLM, SamplingParams
from governor.engine.config import Knobs
from governor.engine.models.checkpoint import model_digest
from governor.engine.models.model_config import UnsupportedModelError, load_model_config
from tests.test_engine_parity import greedy, mixed_prompts


def test_the_engines_knobs_are_the_contracts(llm: LLM) -> None:
    """The engine declares its live knobs once (config.Knobs); the operator and tuner know them by the contract."""
    assert tuple(Knobs.model_fields) == contract.KNOB_NAMES
    assert tuple(llm.engine.knob_caps()) == contract.KNOB_NAMES
    assert tuple(llm.engine.knobs.model_dump()) == contract.KNOB_NAMES


# --- invariance -------------------------------------------------------------------------------

def test_greedy_output_does_not_depend_on_knobs_or_batch(qwen3: Path) -> None:
    target = mixed_prompts(1, seed=5, lo=30, hi=30)[0]
    others = mixed_prompts(7, seed=6)
    alone = LLM(str(qwen3), dtype="float32").generate([target], greedy())[0].outputs[0].token_ids
    for args in ({"max_num_seqs": 1}, {"max_num_seqs": 3, "max_num_batched_tokens": 5},
                 {"max_num_batched_tokens": 1}, {"max_num_seqs": 8, "max_num_batched_tokens": 64}):
        outs = LLM(str(qwen3), dtype="float32", **args).generate([*others[:3], target, *others[3:]], greedy())
        assert outs[3].outputs[0].token_ids == alone, args


# --- block accounting (property) --------------------------------------------------------------

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    max_tokens=st.lists(st.integers(1, 12), min_size=8, max_size=8),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    block_size=st.sampled_from([4, 8, 16]),
    spare_blocks=st.integers(0, 12),
)
def test_every_block_returns_to_the_pool(qwen3: Path, lengths, max_tokens, max_num_seqs, budget, block_size,
                                         spare_blocks) -> None:
    max_model_len = 56
    # At least one full-length sequence fits; few spare blocks force preemption under load.
    num_blocks = -(-max_model_len // block_size) + spare_blocks
    llm = LLM(str(qwen3), dtype="float32", max_model_len=max_model_len, block_size=block_size,
              num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    prompts = [[3 + (i * 7 + j) % 1900 for j in range(n)] for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens[:len(prompts)]]
    engine = llm.engine
    outs: dict[str, object] = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            outs[o.request_id] = o
        engine.kv.check_invariants(engine.scheduler.running)
        held = sum(len(s.block_table) for s in engine.scheduler.running)
        assert held == engine.kv.pool.num_used
        steps += 1
        assert steps < 10_000
    assert llm.stats()["kv_blocks_used"] == 0
    assert sorted(outs) == sorted(str(i) for i in range(len(prompts)))
    for i, sp in enumerate(params):
        assert len(outs[str(i)].outputs[0].token_ids) == sp.max_tokens  # type: ignore[attr-defined]


def test_preempted_requests_finish_with_the_same_tokens(qwen3: Path) -> None:
    prompts = mixed_prompts(5, seed=9, lo=20, hi=40)
    roomy = LLM(str(qwen3), dtype="float32", max_model_len=64).generate(prompts, greedy(20))
    tight = LLM(str(qwen3), dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=20)
    outs = tight.generate(prompts, greedy(20))
    assert tight.stats()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]


# --- sampling ---------------------------------------------------------------------------------

def test_same_seed_same_output_regardless_of_batch(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = mixed_prompts(1, seed=1)[0]
    a = llm.generate([prompt], p)[0].outputs[0].token_ids
    b = llm.generate([*mixed_prompts(3, seed=2), prompt], [SamplingParams(temperature=0.8, max_tokens=5)] * 3 + [p])
    assert b[3].outputs[0].token_ids == a
    other = llm.generate([prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True))
    assert other[0].outputs[0].token_ids != a


def test_filters_that_leave_one_token_equal_greedy(llm: LLM) -> None:
    prompt = mixed_prompts(1, seed=4)[0]
    want = llm.generate([prompt], greedy(10))[0].outputs[0].token_ids
    for p in (SamplingParams(temperature=2.0, top_k=1, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=2.0, top_p=1e-6, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=2.0, min_p=1.0, max_tokens=10, ignore_eos=True)):
        assert llm.generate([prompt], p)[0].outputs[0].token_ids == want


def test_top_k_restricts_samples_to_the_k_most_likely(llm: LLM, hf_model, qwen3: Path) -> None:
    prompt = mixed_prompts(1, seed=8)[0]
    with torch.no_grad():
        logits = hf_model(qwen3)(torch.tensor([prompt])).logits[0, -1]
    top3 = set(logits.topk(3).indices.tolist())
    seen = set()
    for seed in range(40):
        out = llm.generate([prompt], SamplingParams(temperature=5.0, top_k=3, seed=seed, max_tokens=1))
        seen.add(out[0].outputs[0].token_ids[0])
    assert seen <= top3 and len(seen) > 1


def test_logprobs_are_log_softmax_of_the_model(llm: LLM, hf_model, qwen3: Path) -> None:
    prompt = mixed_prompts(1, seed=12)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))[0].outputs[0]
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(qwen3)(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    vals, ids = lp.topk(3)
    assert out.logprobs is not None and len(out.logprobs) == 1
    row = out.logprobs[0]
    assert set(row) == set(ids.tolist())
    for tid, v in zip(ids.tolist(), vals.tolist(), strict=True):
        assert math.isclose(row[tid], v, abs_tol=1e-4)
    assert out.cumulative_logprob is not None and math.isclose(out.cumulative_logprob, vals[0].item(), abs_tol=1e-4)


# --- stopping ---------------------------------------------------------------------------------

def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    prompt = mixed_prompts(1, seed=13)[0]
    free = llm.generate([prompt], greedy(12))[0].outputs[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == free.token_ids[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    assert free.finish_reason == "length" and len(free.token_ids) == 12


def test_stop_string_truncates_text(llm: LLM) -> None:
    prompt = mixed_prompts(1, seed=14)[0]
    free = llm.generate([prompt], greedy(16))[0].outputs[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.find(stop)]


def test_eos_stops_unless_ignored(qwen3: Path, tmp_path: Path) -> None:
    """Make the model's first greedy token the EOS id and check both behaviours."""
    llm = LLM(str(qwen3), dtype="float32")
    prompt = mixed_prompts(1, seed=15)[0]
    first = llm.generate([prompt], greedy(1))[0].outputs[0].token_ids[0]
    ckpt = tmp_path / "eos"
    shutil.copytree(qwen3, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["eos_token_id"] = first
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "generation_config.json").unlink(missing_ok=True)
    eos_llm = LLM(str(ckpt), dtype="float32")
    stopped = eos_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    ignored = eos_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(ignored.outputs[0].token_ids) == 8


def test_text_prompts_and_input_order(llm: LLM) -> None:
    outs = llm.generate(["the model serves", {"prompt": "a queue of requests"}, "x"], greedy(4))
    assert [o.prompt for o in outs] == ["the model serves", "a queue of requests", "x"]
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("the model serves")
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize(("prompt", "params", "match"), [
    ([], SamplingParams(), "empty"),
    ([5] * 250, SamplingParams(max_tokens=10), "max_model_len"),
    ([5, 10**6], SamplingParams(), "vocabulary"),
    ([-1], SamplingParams(), "vocabulary"),
    ({"text": "hi"}, SamplingParams(), "prompt_token_ids"),
])
def test_bad_requests_raise_clear_value_errors(llm: LLM, prompt, params, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2, 3], prompt], params)
    assert llm.stats()["requests_waiting"] == 0  # nothing half-queued


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"logprobs": 99}, "logprobs"),
])
def test_invalid_sampling_values_raise(kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unsupported_architecture_names_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model_config(tmp_path)


def test_kv_cache_too_small_for_max_model_len_is_an_error(qwen3: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(qwen3), dtype="float32", max_model_len=256, block_size=16, num_kv_blocks=4)


def test_model_digest_tracks_weight_contents(qwen3: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(qwen3, copy)
    assert model_digest(copy) == model_digest(qwen3) == LLM(str(qwen3), dtype="float32").engine.model_digest
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_digest(copy) != model_digest(qwen3)


# --- texts of finished requests ---------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_decoder_gives_the_tokenizers_decode_through_its_rust_tokenizer(hf_checkpoint, arch: str) -> None:
    from governor.engine.tokenizer import decoder, load_tokenizer

    tok = load_tokenizer(hf_checkpoint(arch))
    decode = decoder(tok)
    assert decode.__name__ == "rust"  # plain fast tokenizers, no space clean-up: the direct path
    gen = torch.Generator().manual_seed(3)
    lists = [torch.randint(0, len(tok), (n,), generator=gen).tolist() for n in (0, 1, 7, 300)]
    lists.append(tok.all_special_ids + lists[3][:20])  # special tokens kept or skipped
    for skip in (True, False):
        assert [decode(ids, skip) for ids in lists] == [tok.decode(ids, skip_special_tokens=skip) for ids in lists]


def test_decoder_goes_through_decode_where_transformers_cleans_up_spaces(hf_checkpoint,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from governor.engine.tokenizer import decoder, load_tokenizer

    tok = load_tokenizer(hf_checkpoint("qwen3"))
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    decode = decoder(tok)
    assert decode.__name__ == "python"
    assert decode([5, 6, 7], True) == tok.decode([5, 6, 7], skip_special_tokens=True)


def test_finished_requests_get_the_texts_of_their_tokens(llm: LLM) -> None:
    # Equal lengths, so every request ends in the same step; special tokens skipped or kept per request.
    prompts = mixed_prompts(6, seed=21)
    outs = llm.generate(prompts, [greedy(9), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True,
                                                            skip_special_tokens=False)] * 3)
    tok = llm.engine.tokenizer
    for i, o in enumerate(outs):
        c = o.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=i % 2 == 0)
