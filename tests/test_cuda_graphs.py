"""CUDA graphs of decode and verification steps: same greedy tokens as eager, captured once, never again.

On CPU, `EagerGraphs` stands in for the CUDA graph set: "capture" keeps the forward closure and "replay"
runs it, so the runner's padding, staging and graph choice run (Triton kernels under the interpreter)
without a GPU. The `gpu` tests capture real graphs (on a machine with a CUDA GPU; skipped without one).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from governor.engine import LLM
from governor.engine import runner as runner_module
from governor.engine.cuda_graphs import CudaGraphs, GraphKey, capture_sizes
from tests.test_engine_parity import greedy, mixed_prompts
from tests.test_spec_decode import repetitive_prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class EagerGraphs(CudaGraphs):
    """A graph set whose replay re-runs the captured forward eagerly (CPU stand-in)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sizes = {}
        self.num_captures = 0
        self.num_replays = 0
        self.forwards: dict[GraphKey, Callable[[], torch.Tensor]] = {}
        self.replayed: list[GraphKey] = []

    def capture(self, key: GraphKey, forward: Callable[[], torch.Tensor]) -> None:
        self._register(key)
        forward()
        self.forwards[key] = forward

    def replay(self, key: GraphKey) -> torch.Tensor:
        self.num_replays += 1
        self.replayed.append(key)
        return self.forwards[key]()


def run(llm: LLM, prompts: list[list[int]], new_tokens: int,
        knob_change: tuple[int, dict[str, int]] | None = None) -> list[list[int]]:
    """Greedy tokens of every prompt, stepping the engine by hand; `knob_change` = (after step, knobs)."""
    eng = llm.engine
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        eng.add_request(rid, {"prompt_token_ids": p}, greedy(new_tokens))
    done = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step().finished:
            done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if knob_change is not None and steps == knob_change[0]:
            eng.update_knobs(**knob_change[1])
    assert eng.stats()["kv_blocks_used"] == 0
    return [done[rid] for rid in ids]


# --- the ladder ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("cap", "sizes"), [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (8, [1, 2, 4, 8]),
    (37, [1, 2, 4, 8, 16, 24, 32, 37]), (40, [1, 2, 4, 8, 16, 24, 32, 40]),
])
def test_capture_sizes_follow_the_ladder_up_to_the_hard_cap(cap: int, sizes: list[int]) -> None:
    assert capture_sizes(cap) == sizes


def test_a_step_is_padded_to_the_smallest_captured_size_that_holds_it() -> None:
    graphs = EagerGraphs(torch.device("cpu"))
    for b in capture_sizes(10):
        graphs.capture(GraphKey(b, 1), lambda: torch.zeros(1))
    assert [graphs.padded_key(n, 1) for n in (1, 3, 5, 8, 9, 10)] == [
        GraphKey(1, 1), GraphKey(4, 1), GraphKey(8, 1), GraphKey(8, 1), GraphKey(10, 1), GraphKey(10, 1)]
    assert graphs.padded_key(11, 1) is None  # past the hard cap: eager
    assert graphs.padded_key(1, 3) is None  # no verification graphs captured
    with pytest.raises(RuntimeError, match="already captured"):
        graphs.capture(GraphKey(4, 1), lambda: torch.zeros(1))


def test_cuda_graphs_refuse_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphs(torch.device("cpu"))


def test_the_engine_runs_eagerly_on_cpu_and_when_enforced(hf_checkpoint) -> None:
    path = str(hf_checkpoint("llama"))
    for kwargs in ({}, {"enforce_eager": True}):
        llm = LLM(path, dtype="float32", **kwargs)
        assert not llm.engine.executor.use_cuda_graphs
        assert llm.engine.runner.graphs is None


# --- padding and staging, on CPU ------------------------------------------------------------------


@pytest.fixture
def eager_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_module, "CudaGraphs", EagerGraphs)


def _with_graphs(path: Path, **kwargs) -> LLM:
    llm = LLM(str(path), dtype="float32", attention_backend="triton", **kwargs)
    llm.engine.runner.capture_cuda_graphs(llm.engine.config.seqs_cap)
    return llm


def test_capture_writes_no_kv_and_takes_no_blocks(hf_checkpoint, eager_graphs) -> None:
    llm = _with_graphs(hf_checkpoint("llama"), max_num_seqs=6, kv_cache_memory_bytes=2**20)
    assert all(int(k.count_nonzero()) == 0 and int(v.count_nonzero()) == 0 for k, v in llm.engine.kv_caches)
    assert llm.stats()["kv_blocks_used"] == 0
    assert llm.engine.runner.graphs.num_captures == len(capture_sizes(6))


def test_padded_decode_steps_give_the_eager_tokens_with_a_knob_change(hf_checkpoint, eager_graphs) -> None:
    path = hf_checkpoint("llama")
    prompts = mixed_prompts(8, seed=3, hi=30)
    want = run(LLM(str(path), dtype="float32", attention_backend="triton", max_num_seqs=5), prompts, 6)
    llm = _with_graphs(path, max_num_seqs=6)
    llm.engine.update_knobs(max_num_seqs=5)
    graphs = llm.engine.runner.graphs
    captured = graphs.num_captures
    assert run(llm, prompts, 6, knob_change=(2, {"max_num_seqs": 3})) == want
    assert graphs.num_captures == captured
    # 5 sequences pad to 6; after the knob change the other 3 are admitted and pad to 4.
    assert set(graphs.replayed) == {GraphKey(6, 1), GraphKey(4, 1)}


def test_padded_verification_steps_give_the_plain_tokens(hf_checkpoint, eager_graphs) -> None:
    path = hf_checkpoint("qwen3")
    prompts = repetitive_prompts(3, seed=4)
    want = run(LLM(str(path), dtype="float32", attention_backend="triton"), prompts, 10)
    # One step at a time, so that prompt lookup drafts every step it can (with async scheduling it sits out steps
    # after finding nothing).
    llm = _with_graphs(path, max_num_seqs=4, async_scheduling=False,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert run(llm, prompts, 10) == want
    assert any(k.query_len == 4 for k in llm.engine.runner.graphs.replayed)
    assert llm.stats()["spec_accepted_tokens"] > 0


# --- real CUDA graphs ----------------------------------------------------------------------------


@pytest.fixture
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _gpu_pair(path: Path, **kwargs) -> tuple[LLM, LLM]:
    """(graphs, eager) engines of one configuration on the GPU."""
    common = dict(device="cuda", kv_cache_memory_bytes=2**28, **kwargs)
    graphs, eager = LLM(str(path), **common), LLM(str(path), enforce_eager=True, **common)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    return graphs, eager


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("_no_tf32")
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 9])
def test_gpu_graphs_give_the_eager_greedy_tokens_fp32(hf_checkpoint, batch: int) -> None:
    graphs, eager = _gpu_pair(hf_checkpoint("llama"), dtype="float32", max_num_seqs=10)
    prompts = mixed_prompts(batch, seed=batch, hi=40)
    g = graphs.engine.runner.graphs
    assert g.num_captures == len(capture_sizes(10))
    assert run(graphs, prompts, 24) == run(eager, prompts, 24)
    assert g.num_replays > 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("_no_tf32")
def test_gpu_a_knob_change_mid_run_never_recaptures_fp32(hf_checkpoint) -> None:
    graphs, eager = _gpu_pair(hf_checkpoint("qwen3"), dtype="float32", max_num_seqs=12)
    prompts = mixed_prompts(20, seed=8, hi=40)
    g = graphs.engine.runner.graphs
    captured = g.num_captures
    got = run(graphs, prompts, 24, knob_change=(4, {"max_num_seqs": 3, "max_num_batched_tokens": 64}))
    assert got == run(eager, prompts, 24, knob_change=(4, {"max_num_seqs": 3, "max_num_batched_tokens": 64}))
    assert g.num_captures == captured


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("_no_tf32")
def test_gpu_graphs_with_prefix_caching_and_fp8_kv_fp32(hf_checkpoint) -> None:
    graphs, eager = _gpu_pair(hf_checkpoint("qwen3"), dtype="float32", max_num_seqs=8, block_size=16,
                              enable_prefix_caching=True, kv_cache_dtype="fp8")
    prefix = mixed_prompts(1, seed=31, lo=40, hi=40)[0]
    prompts = [prefix + p for p in mixed_prompts(7, seed=32, hi=12)]
    for llm in (graphs, eager):
        run(llm, prompts[:1], 2)  # caches the shared prefix
    assert run(graphs, prompts, 24) == run(eager, prompts, 24)
    assert graphs.stats()["prefix_cache_hit_tokens"] >= 7 * 32
    assert graphs.engine.runner.graphs.num_replays > 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("_no_tf32")
def test_gpu_verification_graphs_give_the_eager_tokens_fp32(hf_checkpoint) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    graphs, eager = _gpu_pair(hf_checkpoint("qwen3"), dtype="float32", max_num_seqs=8, speculative_config=spec,
                              async_scheduling=False)  # prompt lookup every step (see above)
    prompts = repetitive_prompts(6, seed=4)
    assert run(graphs, prompts, 20, knob_change=(5, {"num_speculative_tokens": 1})) == run(
        eager, prompts, 20, knob_change=(5, {"num_speculative_tokens": 1}))
    g = graphs.engine.runner.graphs
    assert g.padded_key(1, 4) is not None and g.num_replays > 0
    assert graphs.stats()["spec_accepted_tokens"] > 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("_no_tf32")
@pytest.mark.parametrize("draft_kind", ["target", "other", "target-fp8"])
def test_gpu_draft_model_graphs_give_the_eager_tokens_fp32(hf_checkpoint, tmp_path, draft_kind) -> None:
    """A draft model's rounds replay its own decode graphs (fed from the round before on the device) and its
    catch-ups its graphs of up to K + 1 tokens a sequence; tokens equal eager's, K changed live included. The target
    as its own draft has its drafts accepted; another random model has nearly all of them rejected; the target
    quantized to fp8 at load as its draft runs the W8A8 one-row kernels in the draft's graphs."""
    from tests.conftest import build_hf_checkpoint

    target = hf_checkpoint("qwen3")
    draft = build_hf_checkpoint(tmp_path / "draft", "qwen3", seed=1) if draft_kind == "other" else target
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    if draft_kind == "target-fp8":
        spec["quantization"] = "fp8"
    graphs, eager = _gpu_pair(target, dtype="float32", max_num_seqs=8, speculative_config=spec)
    prompts = mixed_prompts(6, seed=44, hi=24)
    change = (5, {"num_speculative_tokens": 2})
    assert run(graphs, prompts, 20, knob_change=change) == run(eager, prompts, 20, knob_change=change)
    assert graphs.engine.spec is not None and eager.engine.spec is not None
    draft_graphs = graphs.engine.spec.proposer.runner.graphs  # type: ignore[attr-defined]
    assert draft_graphs is not None and draft_graphs.num_replays > 0
    if draft_kind == "target-fp8":  # the draft's linears hold e4m3 weights; the target's do not
        from governor.engine.models.quantization import QuantizedLinear

        quantized = [m for m in graphs.engine.spec.proposer.model.modules() if isinstance(m, QuantizedLinear)]
        assert quantized and all(m.weight.dtype == torch.float8_e4m3fn for m in quantized)
        assert not any(isinstance(m, QuantizedLinear) for m in graphs.engine.model.modules())
    assert eager.engine.spec.proposer.runner.graphs is None  # type: ignore[attr-defined]
    stats = graphs.stats()
    if draft_kind == "target":  # nearly every draft is accepted (a near-tie may flip between batch shapes)
        assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_proposed_tokens"] > 0
    assert stats["spec_accepted_tokens"] == eager.stats()["spec_accepted_tokens"]


@pytest.mark.gpu
@needs_cuda
def test_gpu_graphs_give_the_eager_tokens_bf16_on_ladder_sizes(tmp_path) -> None:
    """A batch on a captured size runs the same kernels on the same shapes as eager: identical in bf16."""
    from tests.conftest import build_hf_checkpoint

    path = build_hf_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    graphs, eager = _gpu_pair(path, max_num_seqs=8)
    for batch in (1, 4, 8):
        prompts = mixed_prompts(batch, seed=40 + batch, lo=20, hi=40)
        assert run(graphs, prompts, 32) == run(eager, prompts, 32)
