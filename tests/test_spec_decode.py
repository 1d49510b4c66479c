"""Speculative decoding through the engine: greedy output identical to plain decoding, sampled output
distributed exactly as the target's, K live, blocks consistent (fp32 CPU)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from governor.engine import LLM, SamplingParams
from tests.conftest import build_hf_checkpoint
from tests.test_engine_parity import greedy, mixed_prompts


@pytest.fixture(scope="module")
def target(hf_checkpoint) -> Path:
    return hf_checkpoint("qwen3")


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as the target, different weights: acceptance well below 1."""
    return build_hf_checkpoint(tmp_path_factory.mktemp("draft"), "qwen3", seed=1)


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so n-gram lookup finds continuations."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(2, 2000) for _ in range(rng.randint(3, 6))]
        out.append(phrase * rng.randint(3, 5) + [rng.randrange(2, 2000)])
    return out


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_output_is_identical_to_plain_decoding(target: Path, k: int) -> None:
    """One step at a time, so that the proposer runs every step: with async scheduling an n-gram proposer that finds
    nothing sits out steps (tested below), and on these prompts its matches are rare and brief."""
    prompts = repetitive_prompts(6, seed=k) + mixed_prompts(2, seed=k)
    want = tokens(LLM(str(target), dtype="float32").generate(prompts, greedy(20)))
    spec = LLM(str(target), dtype="float32", async_scheduling=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3})
    assert tokens(spec.generate(prompts, greedy(20))) == want
    stats = spec.stats()
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_verification_steps"] > 0
    assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_proposed_tokens"]
    assert stats["spec_acceptance_by_position"][0] >= stats["spec_acceptance_by_position"][-1]
    assert stats["kv_blocks_used"] == 0


def test_a_draft_equal_to_the_target_is_always_accepted(target: Path) -> None:
    prompts = mixed_prompts(4, seed=3)
    want = tokens(LLM(str(target), dtype="float32").generate(prompts, greedy(16)))
    spec = LLM(str(target), dtype="float32",
               speculative_config={"method": "draft_model", "model": str(target), "num_speculative_tokens": 4})
    assert tokens(spec.generate(prompts, greedy(16))) == want
    s = spec.stats()
    assert s["spec_proposed_tokens"] > 0 and s["spec_accepted_tokens"] == s["spec_proposed_tokens"]
    assert s["spec_mean_accepted_length"] == pytest.approx(s["spec_proposed_tokens"] / s["spec_verification_steps"])


def test_a_different_draft_keeps_greedy_output_identical(target: Path, other_draft: Path) -> None:
    prompts = mixed_prompts(5, seed=4)
    want = tokens(LLM(str(target), dtype="float32").generate(prompts, greedy(16)))
    spec = LLM(str(target), dtype="float32", max_num_batched_tokens=13,
               speculative_config={"method": "draft_model", "model": str(other_draft), "num_speculative_tokens": 3})
    assert tokens(spec.generate(prompts, greedy(16))) == want
    s = spec.stats()
    assert s["spec_accepted_tokens"] < s["spec_proposed_tokens"]
    assert s["kv_blocks_used"] == 0
    assert spec.engine.spec.proposer.kv.num_used == 0  # type: ignore[union-attr]


def test_a_draft_quantized_at_load_drafts_in_fp8_and_keeps_greedy_output_identical(target: Path) -> None:
    """speculative_config's 'quantization': 'fp8' quantizes an unquantized draft at load, as the engine's own does
    the target: the draft's decoder linears hold e4m3 weights, the target's keep their dtype, and the output is
    plain decoding's. The draft is the target itself, so its fp8 copy agrees with it where the random model's logits
    are not near ties (measured: 29 of 78 drafts accepted)."""
    from governor.engine.models.quantization import QuantizedLinear

    prompts = mixed_prompts(4, seed=6)
    want = tokens(LLM(str(target), dtype="float32").generate(prompts, greedy(16)))
    spec = LLM(str(target), dtype="float32", speculative_config={
        "method": "draft_model", "model": str(target), "num_speculative_tokens": 3, "quantization": "fp8"})
    assert tokens(spec.generate(prompts, greedy(16))) == want
    proposer = spec.engine.spec.proposer  # type: ignore[union-attr]
    draft_linears = [m for m in proposer.model.modules() if isinstance(m, QuantizedLinear)]
    assert draft_linears and all(m.weight.dtype == torch.float8_e4m3fn for m in draft_linears)
    assert not any(isinstance(m, QuantizedLinear) for m in spec.engine.model.modules())
    s = spec.stats()
    assert 0 < s["spec_accepted_tokens"] < s["spec_proposed_tokens"]


def test_a_draft_quantization_the_draft_cannot_take_is_refused_at_load(target: Path) -> None:
    from governor.engine.models.model_config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="quantization='awq' needs a checkpoint stored that way"):
        LLM(str(target), speculative_config={"method": "draft_model", "model": str(target),
                                             "num_speculative_tokens": 2, "quantization": "awq"})
    with pytest.raises(ValueError, match="'ngram' takes no 'quantization'"):
        LLM(str(target), speculative_config={"method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"})


_HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")


def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts reads of a tensor's value on the host (`_HOST_READS`) while counts["on"] is 1."""
    counts = {"on": 0, "n": 0}

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args, **kwargs):
            counts["n"] += counts["on"]
            return original(self, *args, **kwargs)
        return read

    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    return counts


@pytest.mark.parametrize("k", [1, 4])
def test_a_draft_model_reads_its_drafts_back_once_a_step_whatever_k(target: Path, other_draft: Path,
                                                                  monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    """The draft's rounds feed each round's drafts to the next on the device and sample there (greedy and
    temperature 1 alike), and the verification takes its draft token ids from the device: proposing reads no
    tensor's value on the host, the verification is queued next (given the drafts on the device), and only then
    are the drafts read, exactly once a step, for K = 1 as for 4 (on a GPU, the one time the host waits for the
    draft, which also covers the verification's forward). The Triton backend, as on a GPU: the CPU reference
    attention reads its metadata on the host."""
    llm = LLM(str(target), dtype="float32", attention_backend="triton",
              speculative_config={"method": "draft_model", "model": str(other_draft), "num_speculative_tokens": k})
    spec = llm.engine.spec
    assert spec is not None and spec.drafts_on_device
    reads = count_host_reads(monkeypatch)
    order: list[tuple[str, int]] = []  # (what ran, its host reads)

    def counted(name, fn):
        def run(*args, **kwargs):
            reads.update(on=1, n=0)
            try:
                return fn(*args, **kwargs)
            finally:
                reads["on"] = 0
                order.append((name, reads["n"]))
        return run

    propose, resolve, execute = spec.propose, spec.resolve, llm.engine.executor.execute

    def execute_seen(out, *args, **kwargs):
        if kwargs.get("drafts") is not None:
            order.append(("verification queued", 0))
        return execute(out, *args, **kwargs)

    monkeypatch.setattr(spec, "propose", counted("propose", propose))
    monkeypatch.setattr(spec, "resolve", counted("resolve", resolve))
    monkeypatch.setattr(llm.engine.executor, "execute", execute_seen)
    params = [SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=6, temperature=1.0, seed=3)]
    llm.generate(mixed_prompts(2, seed=21), params)
    steps = [order[i:i + 3] for i, (name, _) in enumerate(order) if name == "propose" and
             i + 1 < len(order) and order[i + 1][0] == "verification queued"]
    assert steps and all(step == [("propose", 0), ("verification queued", 0), ("resolve", 1)] for step in steps), order
    assert llm.stats()["spec_proposed_tokens"] >= k * len(steps)


def test_drafts_read_before_their_verification_give_the_same_tokens(target: Path, other_draft: Path) -> None:
    """The host path (drafts read back before the verification is staged, as under tensor parallelism) and the
    device path give the same tokens and acceptance, greedy and sampled with seeds."""
    prompts = mixed_prompts(4, seed=8)
    params = [SamplingParams(max_tokens=12, temperature=t, seed=5) for t in (0.0, 1.0, 0.0, 0.7)]
    outs = []
    for on_device in (True, False):
        llm = LLM(str(target), dtype="float32", speculative_config={
            "method": "draft_model", "model": str(other_draft), "num_speculative_tokens": 3})
        assert llm.engine.spec is not None
        llm.engine.spec.drafts_on_device = on_device
        outs.append((tokens(llm.generate(prompts, params)), llm.stats()["spec_accepted_tokens"]))
    assert outs[0] == outs[1] and outs[0][1] > 0


def test_an_ngram_proposer_that_finds_nothing_backs_off_and_resets_on_a_draft(target: Path) -> None:
    """After a proposal round without a draft the proposer sits out 1 step, then 2, 4, 8, 8, ...; a draft found
    resets it, and so do a change of K and an admitted sequence, whose next round then does not back off."""
    from governor.engine.spec.decoding import NGRAM_BACKOFF_CAP

    spec = LLM(str(target), dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    sd = spec.engine.spec
    assert sd is not None and not sd.may_skip()
    seen = []
    for _ in range(6):
        sd._back_off(found=False)
        seen.append(sd.skips_left)
    assert seen == [1, 2, 4, 8, 8, 8] and NGRAM_BACKOFF_CAP == 8
    sd.skip_step()
    assert sd.skips_left == 7 and sd.may_skip()
    sd._back_off(found=True)
    assert (sd.backoff, sd.skips_left, sd.may_skip()) == (0, 0, False)
    for _ in range(3):
        sd._back_off(found=False)
    spec.engine.update_knobs(num_speculative_tokens=2)  # the same K: nothing changes
    assert sd.skips_left == 4
    spec.engine.update_knobs(num_speculative_tokens=1)
    assert not sd.may_skip()
    sd._back_off(found=False)  # the round after a reset
    assert not sd.may_skip()
    sd._back_off(found=False)
    assert sd.skips_left == 1


def test_an_admitted_sequence_gets_proposal_rounds_at_once(target: Path) -> None:
    """A proposer backed off after finding nothing for one request tries again, with its next two rounds, as soon
    as another request is admitted."""
    llm = LLM(str(target), dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3, "prompt_lookup_max": 3})
    eng, sd = llm.engine, llm.engine.spec
    assert sd is not None
    first, second = mixed_prompts(2, seed=9)
    llm.generate([first], greedy(16))
    assert llm.stats()["spec_proposed_tokens"] == 0 and sd.backoff == 8  # rounds at decode steps 1, 2, 4, 7, 12
    eng.add_request("new", second, greedy(8))
    eng.step()  # admits it: its prefill
    assert (sd.backoff, sd.may_skip(), sd.fresh) == (0, False, True)
    eng.step()  # its first decode: a round that finds nothing, and does not back off
    assert (sd.backoff, sd.may_skip(), sd.fresh) == (0, False, False)
    eng.step()  # the second round backs off (and the step after it runs ahead)
    assert sd.backoff == 1
    while eng.has_unfinished_requests():
        eng.step()
    assert llm.stats()["spec_proposed_tokens"] == 0


def test_a_draft_model_never_sits_out_and_runs_no_step_ahead(target: Path, other_draft: Path) -> None:
    from tests.test_async_scheduling import count_fed_steps

    llm = LLM(str(target), dtype="float32",
              speculative_config={"method": "draft_model", "model": str(other_draft), "num_speculative_tokens": 2})
    fed = count_fed_steps(llm.engine)
    llm.generate(mixed_prompts(3, seed=11), greedy(12))
    assert llm.engine.spec is not None and not llm.engine.spec.may_skip() and fed[0] == 0


def test_ngram_with_async_scheduling_gives_plain_decodings_tokens_between_back_offs(target: Path) -> None:
    """Async scheduling's default: prompt lookup finds drafts now and then on these prompts, backs off in between
    (steps run ahead), and the tokens are plain decoding's."""
    prompts = repetitive_prompts(6, seed=3) + mixed_prompts(2, seed=3)
    want = tokens(LLM(str(target), dtype="float32").generate(prompts, greedy(20)))
    llm = LLM(str(target), dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert tokens(llm.generate(prompts, greedy(20))) == want
    assert llm.stats()["spec_proposed_tokens"] > 0


def test_prompt_lookup_that_finds_nothing_lets_steps_run_ahead_and_changes_no_token(
        target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy requests whose output repeats nothing of their prompts: n-gram speculation finds no drafts, sits out
    steps that async scheduling then launches ahead (fed decodes), tries again between them, and the tokens are
    plain decoding's."""
    from tests.conftest import count_calls
    from tests.test_async_scheduling import count_fed_steps

    prompts = mixed_prompts(4, seed=9)
    want = tokens(LLM(str(target), dtype="float32").generate(prompts, greedy(24)))
    llm = LLM(str(target), dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3, "prompt_lookup_max": 3})
    assert llm.engine.spec is not None
    fed = count_fed_steps(llm.engine)
    rounds = count_calls(monkeypatch, llm.engine.spec, "propose")
    assert tokens(llm.generate(prompts, greedy(24))) == want
    assert llm.stats()["spec_proposed_tokens"] == 0  # no 3-gram of these outputs repeats
    # The prefill step, then 23 decode steps: proposal rounds at the 1st and 2nd (the first round after a sequence
    # is admitted does not back off), 4th, 7th, 12th and 21st (sitting out 1, 2, 4, 8 between), the rest launched
    # ahead.
    assert rounds["propose"] == 1 + 6 and fed[0] == 23 - 6


def test_greedy_verifications_of_a_step_read_the_device_once(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However many greedy sequences a step verifies, their argmaxes come back in one read (plus one for the
    sequences without drafts, sampled as usual), with greedy output unchanged."""
    prompts = repetitive_prompts(6, seed=3)
    want = tokens(LLM(str(target), dtype="float32").generate(prompts, greedy(20)))
    llm = LLM(str(target), dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert llm.engine.spec is not None
    spec = llm.engine.spec
    counts = count_host_reads(monkeypatch)
    steps: list[tuple[int, int, int]] = []  # (sequences with drafts, without, reads)
    verify = spec.verify

    def verify_counted(sampling, logits, draft_probs, generator):
        counts.update(on=1, n=0)
        try:
            return verify(sampling, logits, draft_probs, generator)
        finally:
            counts["on"] = 0
            with_drafts = sum(1 for s in sampling if s.draft_tokens)
            steps.append((with_drafts, len(sampling) - with_drafts, counts["n"]))

    monkeypatch.setattr(spec, "verify", verify_counted)
    assert tokens(llm.generate(prompts, greedy(20))) == want
    assert any(d >= 2 for d, _, _ in steps), steps  # steps that verified several sequences at once
    assert all(reads <= (d > 0) + (p > 0) for d, p, reads in steps), steps


def test_a_block_filled_by_accepted_drafts_is_cached_once_its_tokens_are_known(target: Path) -> None:
    """With prefix caching on, accepted drafts count as computed before they join the sequence's tokens;
    the block they fill is hashed at the next settle (hashing it at once raised IndexError)."""
    prompts = repetitive_prompts(4, seed=1)
    want = tokens(LLM(str(target), dtype="float32", block_size=4).generate(prompts, greedy(16)))
    llm = LLM(str(target), dtype="float32", block_size=4, enable_prefix_caching=True, async_scheduling=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})  # lookup every step (see above)
    assert tokens(llm.generate(prompts, greedy(16))) == want
    assert llm.stats()["spec_accepted_tokens"] > 0
    again = llm.generate(prompts, greedy(16))  # every full block of the first run is now a cache hit
    assert tokens(again) == want
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


def test_k_is_a_live_knob_that_never_changes_greedy_output(target: Path) -> None:
    prompts = repetitive_prompts(4, seed=9)
    want = tokens(LLM(str(target), dtype="float32").generate(prompts, greedy(24)))
    llm = LLM(str(target), dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, greedy(24))
    outs, steps = {}, 0
    while eng.has_unfinished_requests():
        steps += 1
        if steps == 3:
            eng.update_knobs(num_speculative_tokens=0)
            proposed = eng.stats()["spec_proposed_tokens"]
        if steps == 6:
            assert eng.stats()["spec_proposed_tokens"] == proposed  # K=0: no speculation
            eng.update_knobs(num_speculative_tokens=2)
        for o in eng.step().finished:
            outs[o.request_id] = o.outputs[0].token_ids
    assert [outs[str(i)] for i in range(len(prompts))] == want
    with pytest.raises(ValueError, match=r"num_speculative_tokens=5 is outside \[0, 4\]"):
        eng.update_knobs(num_speculative_tokens=5)


def test_bad_speculative_configs_are_refused(target: Path) -> None:
    with pytest.raises(ValueError, match="needs 'model'"):
        LLM(str(target), speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        LLM(str(target), speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                             "prompt_lookup_min": 5, "prompt_lookup_max": 2})


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 4), budget=st.integers(2, 24), spare=st.integers(0, 6), seed=st.integers(0, 99),
       prefix_caching=st.booleans())
def test_speculation_keeps_block_invariants_under_preemption(target: Path, k, budget, spare, seed,
                                                            prefix_caching) -> None:
    prompts = repetitive_prompts(5, seed)
    kwargs = dict(dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=16 + spare, max_num_seqs=4,
                  max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching)
    want = tokens(LLM(str(target), **kwargs).generate(prompts, greedy(10)))
    llm = LLM(str(target), speculative_config={"method": "ngram", "num_speculative_tokens": k}, **kwargs)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, greedy(10))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step().finished:
            outs[o.request_id] = o.outputs[0].token_ids
        eng.kv.check_invariants(eng.scheduler.running)
        holders = Counter(b for s in eng.scheduler.running for b in s.block_table)
        assert all(eng.kv.pool.ref_counts[b] == c for b, c in holders.items())
        assert len(holders) == eng.kv.pool.num_used
        for s in eng.scheduler.running:  # rejected drafts leave no blocks behind
            assert len(s.block_table) == -(-s.num_computed_tokens // 4)
    assert [outs[str(i)] for i in range(len(prompts))] == want
    assert llm.stats()["kv_blocks_used"] == 0


def test_sampled_speculation_follows_the_target_distribution(tmp_path: Path) -> None:
    """Tiny vocabulary (16), temperature 1, a draft with other weights: the first generated token (which
    goes through rejection sampling) is distributed as the target's next-token distribution."""
    tgt = build_hf_checkpoint(tmp_path / "t", "llama", seed=5, weight_scale=1.5, vocab_size=16)
    dft = build_hf_checkpoint(tmp_path / "d", "llama", seed=6, weight_scale=1.5, vocab_size=16)
    prompt = [3, 7, 1, 12, 5]
    n = 3000
    llm = LLM(str(tgt), dtype="float32", max_num_seqs=512, max_num_batched_tokens=4096,
              speculative_config={"method": "draft_model", "model": str(dft), "num_speculative_tokens": 2})
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True)
                                       for i in range(n)])
    s = llm.stats()
    assert 0 < s["spec_accepted_tokens"] < s["spec_proposed_tokens"]  # rejection sampling was exercised
    p = torch.softmax(llm.engine.prompt_logits(prompt)[-1], dim=0)
    observed = Counter(o.outputs[0].token_ids[0] for o in outs)
    f_obs = [observed.get(t, 0) for t in range(16)]
    # Expected counts from the float64 probabilities renormalized to n exactly: chisquare rejects sums that
    # differ from n by more than its 1.5e-8 tolerance (a float32 GPU softmax sums to 1 ± 5e-8).
    def expected(probs: torch.Tensor) -> list[float]:
        probs = probs.double()
        return (probs / probs.sum() * n).tolist()

    assert chisquare(f_obs, expected(p)).pvalue > 1e-3
    # The same test rejects the draft's own distribution: it has the power to fail.
    q = torch.softmax(LLM(str(dft), dtype="float32").engine.prompt_logits(prompt)[-1], dim=0)
    assert chisquare(f_obs, expected(q)).pvalue < 1e-6
