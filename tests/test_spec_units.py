"""Speculative decoding units: n-gram proposals, greedy acceptance, and exactness of speculative sampling.

Exactness is checked statistically: with fixed seeds, chi-square goodness-of-fit of the emitted tokens
against the target's distribution must not reject (p > 1e-3), while the same test must reject
deliberately wrong acceptance rules (so it can fail).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from governor.engine.sampler import filtered_logits
from governor.engine.sampling_params import SamplingParams
from governor.engine.spec.ngram import NgramIndex, propose_ngram
from governor.engine.spec.verifier import accept_greedy, accept_sampled, target_distributions

# ---------------------------------------------------------------------------------------------- n-gram


def reference_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, written as the O(L^2) scan: longest n first, then the most recent earlier start."""
    if k == 0:
        return []
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        for i in range(length - n - 1, -1, -1):
            if token_ids[i:i + n] == suffix:
                return token_ids[i + n:i + n + k]
    return []


@pytest.mark.parametrize(("tokens", "k", "min_n", "max_n", "want"), [
    ([1, 2, 3, 4, 1, 2, 3], 2, 1, 3, [4, 1]),  # 3-gram [1, 2, 3] seen at 0
    ([1, 2, 3, 8, 9, 3, 7, 1, 2, 3], 2, 1, 3, [8, 9]),  # the 3-gram wins over the later 1-gram [3] → [7, 1]
    ([1, 2, 3, 8, 9, 3, 7, 1, 2, 3], 2, 1, 1, [7, 1]),  # capped at n = 1: the most recent [3]
    ([1, 2, 5, 1, 2, 6, 1, 2], 1, 2, 2, [6]),  # most recent occurrence, not the first
    ([1, 2, 3, 1, 2], 5, 1, 2, [3, 1, 2]),  # truncated at the end; proposes the suffix's own tokens
    ([7, 7, 7], 3, 1, 2, [7]),  # the occurrence may overlap the suffix, just not be it
    ([1, 2, 9, 2], 3, 1, 3, [9, 2]),  # only a 1-gram matches
    ([1, 2, 9, 2], 3, 2, 3, []),  # ... which is below min_n
    ([1, 2, 3, 4], 3, 1, 3, []),  # no token repeats
    ([1, 2, 3, 1, 2], 0, 1, 2, []),  # k == 0
    ([], 3, 1, 2, []),
    ([5], 3, 1, 2, []),
])
def test_ngram_proposes_the_continuation_of_the_most_recent_longest_match(
        tokens: list[int], k: int, min_n: int, max_n: int, want: list[int]) -> None:
    assert propose_ngram(tokens, k, min_n, max_n) == want


@pytest.mark.parametrize(("k", "min_n", "max_n"), [(-1, 1, 2), (2, 0, 2), (2, 3, 2)])
def test_ngram_rejects_bad_arguments(k: int, min_n: int, max_n: int) -> None:
    with pytest.raises(ValueError, match="propose_ngram needs"):
        propose_ngram([1, 2, 1], k, min_n, max_n)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), k=st.integers(0, 6), min_n=st.integers(1, 3),
       extra_n=st.integers(0, 3))
def test_ngram_proposal_follows_an_earlier_occurrence_of_the_suffix(
        tokens: list[int], k: int, min_n: int, extra_n: int) -> None:
    max_n = min_n + extra_n
    got = propose_ngram(tokens, k, min_n, max_n)
    assert got == reference_ngram(tokens, k, min_n, max_n)
    if not got:
        return
    length = len(tokens)
    # Some n in range and some earlier start i have tokens[i:i+n] == suffix and got == what followed it.
    assert any(tokens[i:i + n] == tokens[length - n:] and tokens[i + n:i + n + len(got)] == got
               and len(got) == min(k, length - i - n)
               for n in range(min_n, max_n + 1) for i in range(length - n))


def test_ngram_on_a_long_sequence_matches_the_reference() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 40, size=4000).tolist()
    tokens += tokens[1000:1010]  # the last 8 tokens also occur at 1002..1009, followed by 1010..
    assert propose_ngram(tokens, 5, 2, 8) == reference_ngram(tokens, 5, 2, 8) == tokens[1010:1015]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), chunks=st.lists(st.integers(1, 20), min_size=1),
       k=st.integers(1, 6), min_n=st.integers(1, 3), extra_n=st.integers(0, 3))
def test_the_incremental_index_proposes_what_the_search_does_after_every_token(
        tokens: list[int], chunks: list[int], k: int, min_n: int, extra_n: int) -> None:
    """Fed in chunks of any size (a step appends one token or several accepted drafts, one by one; a prompt comes
    whole, in bulk), the index's match gives the reference's proposal at every length it is asked at."""
    max_n = min_n + extra_n
    index = NgramIndex(min_n, max_n)
    fed = 0
    for size in itertools.cycle(chunks):
        index.extend(tokens[fed:fed + size])
        fed = min(fed + size, len(tokens))
        end = index.match()
        got = [] if end is None else tokens[end + 1:min(end + 1 + k, fed)]
        assert index.length == fed and got == reference_ngram(tokens[:fed], k, min_n, max_n)
        if fed == len(tokens):
            break


def test_the_index_finds_a_long_match_in_a_long_sequence() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 40, size=4000).tolist()
    tokens += tokens[1000:1010]
    index = NgramIndex(2, 8)
    index.extend(tokens)
    assert index.match() == 1009  # the 8-gram ending at 1009 → proposes tokens[1010:]
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramIndex(3, 2)


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize(("target_argmax", "draft", "want"), [
    ([4, 5, 6, 7], [4, 5, 6], [4, 5, 6, 7]),  # all accepted: k drafts + the target's next token
    ([9, 5, 6, 7], [4, 5, 6], [9]),  # first rejected: the target's own pick only
    ([4, 5, 8, 7], [4, 5, 6], [4, 5, 8]),  # partial: accepted prefix + the target's correction
    ([4, 0, 6, 7], [4, 5, 6], [4, 0]),  # a later match after a rejection does not count
    ([3], [], [3]),  # k == 0
])
def test_greedy_acceptance_keeps_the_agreeing_prefix_and_the_targets_next_token(
        target_argmax: list[int], draft: list[int], want: list[int]) -> None:
    assert accept_greedy(target_argmax, draft) == want


def test_greedy_acceptance_needs_one_more_target_token_than_drafts() -> None:
    with pytest.raises(ValueError, match="len\\(draft\\) \\+ 1"):
        accept_greedy([1, 2], [1, 2])


# ----------------------------------------------------------------------------- target distributions


def test_target_distributions_are_the_samplers_filtered_softmax_and_greedy_is_a_point_mass() -> None:
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(top_p=0.5), SamplingParams(temperature=0.0),
              SamplingParams(min_p=0.2)]
    probs = target_distributions(logits, params)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(4))
    for i in (0, 1, 3):
        torch.testing.assert_close(probs[i], filtered_logits(logits[i:i + 1], params[i:i + 1]).softmax(dim=1)[0])
    assert int((probs[0] > 0).sum()) == 3
    assert probs[2].tolist() == torch.nn.functional.one_hot(logits[2].argmax(), 10).float().tolist()


def test_sampled_acceptance_on_greedy_distributions_is_greedy_acceptance() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        logits = torch.randn(4, 6, generator=g)
        probs = target_distributions(logits, [SamplingParams(temperature=0.0)] * 4)
        draft = torch.randint(0, 6, (3,), generator=g).tolist()
        want = accept_greedy(logits.argmax(dim=1).tolist(), draft)
        assert accept_sampled(probs, draft, None, g) == want


# ------------------------------------------------------------------------------------- sampled: edges


def test_sampled_acceptance_with_no_drafts_samples_the_target() -> None:
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert accept_sampled(p, [], None, torch.Generator().manual_seed(0)) == [2]


def test_a_draft_the_draft_model_gave_zero_probability_is_rejected() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    # q(0) == 0: reject; the residual max(p - q, 0) is all on token 0.
    assert accept_sampled(p, [0], q, torch.Generator().manual_seed(0)) == [0]


def test_a_zero_residual_falls_back_to_the_target() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # p == q and the draft has q == 0 (rejected), so max(p - q, 0) == 0: draw from p.
    assert accept_sampled(p, [2], p[:1].clone(), torch.Generator().manual_seed(0)) == [1]


def test_sampled_acceptance_draws_only_from_its_generator() -> None:
    p = torch.full((3, 5), 0.2)
    q = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1]] * 2)
    runs = []
    for default_seed in (1, 2):
        torch.manual_seed(default_seed)
        g = torch.Generator().manual_seed(7)
        runs.append([accept_sampled(p, [0, 0], q, g) for _ in range(30)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize(("target_shape", "draft_shape"), [((2, 5), None), ((3, 5), (1, 5)), ((3, 5), (2, 4))])
def test_sampled_acceptance_rejects_mismatched_shapes(target_shape: tuple[int, int],
                                                      draft_shape: tuple[int, int] | None) -> None:
    q = None if draft_shape is None else torch.full(draft_shape, 0.2)
    with pytest.raises(ValueError, match="must be"):
        accept_sampled(torch.full(target_shape, 0.2), [0, 1], q, None)


# ----------------------------------------------------------------------------------- sampled: exactness

V = 6
Accept = Callable[[torch.Tensor, list[int], torch.Tensor | None, torch.Generator | None], list[int]]


def random_dist(rows: int, masked: list[int], seed: int) -> torch.Tensor:
    """Rows of a random distribution over V tokens bounded away from 0, with token masked[j] of row j set to 0
    (as top-k/top-p filtering does) for the first len(masked) rows."""
    rng = np.random.default_rng(seed)
    probs = 0.5 * rng.dirichlet(np.ones(V), size=rows) + 0.5 / V
    probs[np.arange(len(masked)), masked] = 0.0
    return torch.tensor(probs / probs.sum(axis=1, keepdims=True), dtype=torch.float32)


def step_outcomes(accept: Accept, p: torch.Tensor, q: torch.Tensor | None, fixed_draft: list[int] | None,
                  trials: int, seed: int) -> np.ndarray:
    """[trials, k+1] tokens: one verification step each, drafts from q (or `fixed_draft`), and where the step
    stopped early, the remaining positions completed by fresh draws from the target rows p_j."""
    k = p.shape[0] - 1
    side = torch.Generator().manual_seed(seed + 1)  # drafts and completions; independent of the verifier's draws
    if q is not None and k > 0:
        drafts = torch.stack([torch.multinomial(q[j], trials, replacement=True, generator=side) for j in range(k)])
        draft_rows = drafts.T.tolist()
    elif q is not None:
        draft_rows = [[]] * trials
    else:
        assert fixed_draft is not None
        draft_rows = [fixed_draft] * trials
    completions = torch.stack([torch.multinomial(p[j], trials, replacement=True, generator=side)
                               for j in range(k + 1)]).T.numpy()
    out = completions.copy()
    g = torch.Generator().manual_seed(seed)
    for t, draft in enumerate(draft_rows):
        emitted = accept(p, draft, q, g)
        out[t, :len(emitted)] = emitted
    return out


def joint_chi2_pvalue(outcomes: np.ndarray, p: torch.Tensor) -> float:
    """Chi-square p-value of the observed (x_1..x_{k+1}) against prod_j p_j(x_j); cells the target gives
    probability 0 must be empty."""
    rows = p.shape[0]
    cells = np.ravel_multi_index(outcomes.T, (V,) * rows) if rows > 1 else outcomes[:, 0]
    observed = np.bincount(cells, minlength=V ** rows)
    expected = np.array([np.prod([float(p[j, x[j]]) for j in range(rows)])
                         for x in itertools.product(range(V), repeat=rows)])
    assert observed[expected == 0].sum() == 0, "a token the target filtered out was emitted"
    support = expected > 0
    f_exp = expected[support] / expected[support].sum() * len(outcomes)
    return float(stats.chisquare(observed[support], f_exp=f_exp).pvalue)


@pytest.mark.parametrize(("k", "trials"), [(0, 8000), (1, 20000), (2, 20000)])
def test_draft_model_speculative_sampling_emits_exactly_the_targets_distribution(k: int, trials: int) -> None:
    """Drafts d_j ~ q_j; the target rows p_j are fixed, so the target's distribution at position j does not depend
    on the tokens before it and the step's k+1 tokens (completed by fresh p_j draws where it stopped early) must be
    distributed as prod_j p_j(x_j). p masks a token q proposes; q masks a token p allows."""
    p = random_dist(k + 1, masked=[0, 1, 2][:k + 1], seed=10 + k)
    q = random_dist(k, masked=[5, 4][:k], seed=20 + k)
    outcomes = step_outcomes(accept_sampled, p, q, None, trials, seed=k)
    assert joint_chi2_pvalue(outcomes, p) > 1e-3


@pytest.mark.parametrize("draft", [[2], [0], [2, 3], [3, 1]])
def test_ngram_speculative_sampling_emits_exactly_the_targets_distribution(draft: list[int]) -> None:
    """A deterministic proposer (q_j one-hot on d_j) with fixed drafts; p_j fixed as above, so the k+1 tokens must be
    distributed as prod_j p_j(x_j). Token 0 of row 0 and token 1 of row 1 are masked in p (drafts always rejected)."""
    k = len(draft)
    p = random_dist(k + 1, masked=[0, 1, 2][:k + 1], seed=30 + k)
    outcomes = step_outcomes(accept_sampled, p, None, draft, 12000, seed=40 + k)
    assert joint_chi2_pvalue(outcomes, p) > 1e-3


def accept_everything(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                      g: torch.Generator | None) -> list[int]:
    """Wrong: keeps every draft, so x_1 ~ q_1."""
    return [*draft, int(torch.multinomial(p[len(draft)], 1, generator=g))]


def resample_target_on_rejection(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                                 g: torch.Generator | None) -> list[int]:
    """Wrong: the right acceptance test, but a rejection draws from p_j instead of the residual, over-weighting
    min(p, q)."""
    q = torch.nn.functional.one_hot(torch.tensor(draft), V).float() if q is None else q
    for j, d in enumerate(draft):
        if float(torch.rand(1, generator=g)) * float(q[j, d]) >= float(p[j, d]):
            return [*draft[:j], int(torch.multinomial(p[j], 1, generator=g))]
    return [*draft, int(torch.multinomial(p[len(draft)], 1, generator=g))]


@pytest.mark.parametrize("wrong_rule", [accept_everything, resample_target_on_rejection])
@pytest.mark.parametrize("draft_model", [True, False])
def test_the_exactness_test_rejects_a_wrong_acceptance_rule(wrong_rule: Accept, draft_model: bool) -> None:
    """Same harness and test as the exactness tests (no masked tokens, so the chi-square alone must reject)."""
    p = random_dist(2, masked=[], seed=11)
    q = random_dist(1, masked=[], seed=21) if draft_model else None
    outcomes = step_outcomes(wrong_rule, p, q, None if draft_model else [2], 6000, seed=1)
    assert joint_chi2_pvalue(outcomes, p) < 1e-6


# ---------------------------------------------------------------------------------- sampled: acceptance


def acceptance_counts(p: torch.Tensor, q: torch.Tensor, trials: int) -> list[int]:
    """How many of the k drafts each of `trials` steps accepted, drafts drawn from q."""
    k = q.shape[0]
    side, g = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    drafts = torch.stack([torch.multinomial(q[j], trials, replacement=True, generator=side) for j in range(k)]).T
    return [len(accept_sampled(p, d, q, g)) - 1 for d in drafts.tolist()]


def test_a_draft_model_equal_to_the_target_is_always_accepted() -> None:
    p = random_dist(4, masked=[0, 1, 2, 3], seed=5)
    assert set(acceptance_counts(p, p[:3].clone(), 2000)) == {3}


def test_a_draft_model_with_disjoint_support_is_never_accepted() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0, 0.0]] * 3)
    q = torch.tensor([[0.0, 0.0, 0.0, 0.2, 0.3, 0.5]] * 2)
    assert set(acceptance_counts(p, q, 2000)) == {0}


def test_the_first_draft_is_accepted_at_rate_sum_min_p_q() -> None:
    p = random_dist(2, masked=[0, 1], seed=6)
    q = random_dist(1, masked=[5], seed=7)
    accepted = sum(c >= 1 for c in acceptance_counts(p, q, 4000))
    rate = float(torch.minimum(p[0], q[0]).sum())  # P(accept) = sum_x q(x) min(1, p(x)/q(x))
    assert stats.binomtest(accepted, 4000, rate).pvalue > 1e-3


def test_initial_k_starts_below_its_cap_and_is_checked() -> None:
    from governor.engine.config import EngineConfig

    spec = {"method": "ngram", "num_speculative_tokens": 4}
    cfg = EngineConfig(model="m", speculative_config=spec, num_speculative_tokens=2)
    assert (cfg.initial_knobs().num_speculative_tokens, cfg.spec_cap) == (2, 4)
    assert EngineConfig(model="m", speculative_config=spec).initial_knobs().num_speculative_tokens == 4
    with pytest.raises(ValueError, match="exceeds the speculative cap 4"):
        EngineConfig(model="m", speculative_config=spec, num_speculative_tokens=5)
    with pytest.raises(ValueError, match="no speculative_config is set"):
        EngineConfig(model="m", num_speculative_tokens=1)
