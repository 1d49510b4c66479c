"""The kernel warm-up at engine start (CUDA, Triton backend): throwaway prefill and mixed steps that pay the
one-time costs of each step size before the first request does (docs/design/step-pipeline.md, "Warm-up at start").

Triton compiles a kernel once per specialization: besides its constexprs, each integer argument is told apart as
1, a multiple of 16, or neither. Decode steps are compiled by the graph capture; the steps here give the eager
ones -- prefill chunks alone and after decodes, one and several sequences -- token and sequence counts of each
kind, then a ladder of sizes up to the token budget (`ladder_steps`), then steps at the budget (`budget_steps`).
Their blocks are lent by the KV manager and go back to it unhashed (what they write there is never read); no counter
moves. A step that does not fit the hard caps, max_model_len or the free blocks is left out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from governor.engine.kv.kv_manager import KVManager
from governor.engine.sampling_params import SamplingParams
from governor.engine.scheduler import ScheduledSeq, SchedulerOutput
from governor.engine.sequence import Sequence

log = logging.getLogger("governor.engine")

WarmUpStep = tuple[int, tuple[int, ...]]  # (decodes, prefill chunk lengths)

# Decodes are 6-token sequences with their last token to compute.
_SPECIALIZATION_STEPS: list[WarmUpStep] = [(0, (32,)), (0, (33,)), (0, (17, 16)), (1, (16,)), (3, (29,)),
                                           (16, (17,)), (16, (16,))]


def warm_up_steps(tokens_cap: int, seqs_cap: int, max_model_len: int) -> list[WarmUpStep]:
    """Every step the warm-up tries, in order, before the fit checks."""
    return (_SPECIALIZATION_STEPS + ladder_steps(tokens_cap, max_model_len)
            + budget_steps(tokens_cap, seqs_cap, max_model_len))


def ladder_steps(tokens_cap: int, max_model_len: int) -> list[WarmUpStep]:
    """Prefill steps of 64 * 2^k and 96 * 2^k tokens below the token budget (one chunk each, at most max_model_len),
    so the GEMMs of the step sizes between the small steps and the budget run once here. cuBLAS picks its kernels
    by problem size, and CUDA loads a kernel's module on its first launch (lazy loading, torch's default). On an
    H200 (qwen3-0.6b shape, 256 x 100 -> 1,024 tokens, fp8 KV), the first run's first mixed step (243 decodes
    beside 13 prompt chunks, 1,511 tokens) took 75.4 ms against 18.2 in a second run, and 43.6 against 26.8 with
    CUDA_MODULE_LOADING=EAGER; the first run was 57.3K tok/s against 58.8K under eager loading
    (docs/design/step-pipeline.md)."""
    sizes = sorted({min(b << k, max_model_len) for b in (64, 96) for k in range(20) if (b << k) < tokens_cap})
    return [(0, (n,)) for n in sizes]


def budget_steps(tokens_cap: int, seqs_cap: int, max_model_len: int) -> list[WarmUpStep]:
    """Steps of the hard token budget: one sequence's chunk, up to 64 sequences' prompts, and a decode batch beside
    one chunk, each chunk at most max_model_len (the step then stays under the budget). The first full-size steps
    of a process cost more than later ones: on an H200 (qwen3-0.6b shape, 256 prompts of 100 tokens, fp8 KV, after
    the small steps above) the first 8,192-token prefill step took 346 ms against 36 ms in a second run, the next
    three 6-52 ms more each (docs/design/step-pipeline.md). What the time goes to was not broken down (candidates:
    GEMM kernels for that many rows loaded on first use, the activations' first allocation); these steps reach the
    sizes where it is paid. The budget is the hard cap, which the tuner may raise the knob to: a cap whose
    activations do not fit beside the KV cache fails here, at start, rather than when the knob first reaches it."""

    def fit(n: int) -> int:
        return min(n, max_model_len)

    steps: list[WarmUpStep] = [(0, (fit(tokens_cap),))]
    many = min(seqs_cap, 64, tokens_cap)
    if many > 1:
        size, extra = divmod(tokens_cap, many)
        steps.append((0, (fit(size + extra),) + (fit(size),) * (many - 1)))
    decodes = min(seqs_cap - 1, tokens_cap // 2)
    if decodes > 0:
        steps.append((decodes, (fit(tokens_cap - decodes),)))
    return steps


def warm_up_kernels(execute: Callable[[SchedulerOutput], object], kv: KVManager, seqs_cap: int,
                    tokens_cap: int, max_model_len: int, device: torch.device) -> None:
    """Run each step of `warm_up_steps` that fits through `execute` (the engine's step), with blocks lent by `kv`."""
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for num_decodes, prefills in warm_up_steps(tokens_cap, seqs_cap, max_model_len):
        # A decode: a 6-token sequence whose first 5 tokens are computed (made so, never stepped there).
        scheduled = [ScheduledSeq(Sequence("warm-up", -1, [1] * 5, params, 1, output_token_ids=[1],
                                           num_computed_tokens=5), 1) for _ in range(num_decodes)]
        scheduled += [ScheduledSeq(Sequence("warm-up", -1, [1] * n, params, 1), n) for n in prefills]
        blocks = sum(kv.blocks_for(s.seq.num_tokens) for s in scheduled)
        longest = max(s.seq.num_tokens for s in scheduled)
        if (len(scheduled) > seqs_cap or num_decodes + sum(prefills) > tokens_cap
                or longest > max_model_len or blocks > kv.num_free):
            continue
        try:
            for s in scheduled:
                kv.allocate(s.seq, s.num_new_tokens)
            execute(SchedulerOutput(scheduled))
        finally:
            for s in scheduled:
                kv.free(s.seq)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    log.info("kernels of prefill and mixed steps compiled in %.1f s", time.perf_counter() - t0)
