"""Tensor parallelism on CPU (gloo, two ranks: this process and one spawned worker): the same greedy
tokens and prompt logits as one rank, clear errors for sizes that do not split the model, and no
worker process outliving its engine. The GPU test at the end runs NCCL on two GPUs.

One tensor-parallel engine per process at a time (torch.distributed's default group): the parity
tests share one two-rank engine per architecture through a class-scoped fixture, closed before the
next architecture's starts and before the tests below the class make their own.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from governor.engine import LLM
from governor.engine.cli import main as governor_main
from governor.engine.config import EngineConfig
from governor.engine.executor import resolve_worker_spec
from governor.engine.models.make_model import make_model
from governor.engine.models.model_config import load_model_config
from governor.engine.worker import Worker
from tests.conftest import build_hf_checkpoint
from tests.test_engine_parity import greedy, hf_greedy, mixed_prompts
from tests.test_spec_decode import repetitive_prompts, tokens

NEW_TOKENS = 16
# One static configuration serves every parity setup: the setups differ only in live knobs. 12 blocks of
# 8 tokens for 6 sequences of up to 45 + 16 tokens: every setup preempts.
STATIC: dict[str, Any] = dict(dtype="float32", block_size=8, num_kv_blocks=12, max_model_len=80,
                              enable_prefix_caching=True,
                              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3})
SETUPS = {
    "default": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "num_speculative_tokens": 0},
    "chunked": {"max_num_seqs": 256, "max_num_batched_tokens": 7, "num_speculative_tokens": 0},
    "queued": {"max_num_seqs": 2, "max_num_batched_tokens": 16, "num_speculative_tokens": 0},
    "speculative": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "num_speculative_tokens": 3},
}


@dataclass
class Pair:
    arch: str
    path: Path
    one: LLM  # tensor_parallel_size 1
    two: LLM  # tensor_parallel_size 2

    def both(self) -> tuple[LLM, LLM]:
        return self.one, self.two


def set_knobs(pair: Pair, knobs: dict[str, int]) -> None:
    for llm in pair.both():
        llm.engine.update_knobs(**knobs)


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(scope="class", params=["llama", "qwen2", "qwen3"])
def pair(request: pytest.FixtureRequest, hf_checkpoint) -> Iterator[Pair]:
    """The same checkpoint on one rank and on two (qwen2: sliced qkv biases; qwen3: q/k norms)."""
    path = hf_checkpoint(request.param)
    with LLM(str(path), tensor_parallel_size=2, **STATIC) as two_ranks:
        yield Pair(request.param, path, LLM(str(path), **STATIC), two_ranks)
    assert multiprocessing.active_children() == []


class TestTwoRanksComputeWhatOneDoes:
    @pytest.mark.parametrize("setup", SETUPS)
    def test_greedy_tokens_are_identical(self, pair: Pair, setup: str) -> None:
        set_knobs(pair, SETUPS[setup])
        prompts = mixed_prompts(6, seed=list(SETUPS).index(setup))
        before = [llm.stats()["preemptions"] for llm in pair.both()]
        one, two = (llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(NEW_TOKENS))
                    for llm in pair.both())
        assert tokens(two) == tokens(one)
        assert two[0].outputs[0].finish_reason == "length"
        preempted = [llm.stats()["preemptions"] - b for llm, b in zip(pair.both(), before, strict=True)]
        assert preempted[1] == preempted[0] > 0
        assert pair.two.stats()["kv_blocks_used"] == 0

    def test_greedy_tokens_match_transformers(self, pair: Pair, hf_model) -> None:
        set_knobs(pair, SETUPS["default"])
        prompts = mixed_prompts(3, seed=1, hi=30)
        outs = pair.two.generate([{"prompt_token_ids": p} for p in prompts], greedy(12))
        model = hf_model(pair.path)
        assert tokens(outs) == [hf_greedy(model, p, 12) for p in prompts]

    @pytest.mark.parametrize("chunk", [5, 64])
    def test_prompt_logits_agree_within_1e_4(self, pair: Pair, chunk: int) -> None:
        prompt = mixed_prompts(1, seed=7, lo=37, hi=37)[0]
        one, two = (llm.engine.prompt_logits(prompt, chunk) for llm in pair.both())
        assert two.shape == one.shape == (37, pair.one.engine.model_config.vocab_size)
        torch.testing.assert_close(two, one, rtol=0, atol=1e-4)

    def test_a_prefix_cache_hit_reuses_every_ranks_shard(self, pair: Pair) -> None:
        set_knobs(pair, SETUPS["default"])
        prompt = [{"prompt_token_ids": mixed_prompts(1, seed=11, lo=41, hi=41)[0]}]
        before = pair.two.stats()["prefix_cache_hit_tokens"]
        cold = tokens(pair.two.generate(prompt, greedy(8)))
        warm = tokens(pair.two.generate(prompt, greedy(8)))
        assert pair.two.stats()["prefix_cache_hit_tokens"] - before == 40  # five full blocks of 8
        assert warm == cold == tokens(pair.one.generate(prompt, greedy(8)))

    def test_ngram_verification_steps_give_the_same_tokens(self, pair: Pair) -> None:
        set_knobs(pair, SETUPS["speculative"])
        prompts = [p[:-1] for p in repetitive_prompts(4, seed=2)]  # each ends in its phrase: drafts at once
        before = pair.two.stats()["spec_verification_steps"]
        one, two = (tokens(llm.generate(prompts, greedy(16))) for llm in pair.both())
        assert two == one
        stats = pair.two.stats()
        assert stats["spec_verification_steps"] > before and stats["spec_proposed_tokens"] > 0


# --- below the class: each test opens (and closes) its own two-rank engine --------------------------


@pytest.mark.parametrize(("arch", "size", "named"), [
    ("llama3-rope-mqa", 2, "num_key_value_heads=1"),
    ("llama", 3, "num_attention_heads=4, num_key_value_heads=2"),
])
def test_a_size_that_does_not_split_the_model_is_refused_before_any_worker_starts(
        hf_checkpoint, arch: str, size: int, named: str) -> None:
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={size} does not divide {named}") as raised:
        LLM(str(hf_checkpoint(arch)), tensor_parallel_size=size)
    assert "intermediate_size=128" in str(raised.value)  # the message names all three numbers
    assert multiprocessing.active_children() == []


def test_every_rank_takes_rank_0s_float32_matmul_precision(hf_checkpoint) -> None:
    """A worker process starts at PyTorch's default; rank 0's setting (no TF32 for an fp32 comparison, say) travels in
    the spec, so that every rank rounds its shard of a float32 product alike."""
    path = str(hf_checkpoint("llama"))
    config = EngineConfig(model=path, device="cpu", dtype="float32")
    mc = load_model_config(path)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        spec = resolve_worker_spec(config, mc, 64, mc.vocab_size)
        assert spec.float32_matmul_precision == "medium"
        torch.set_float32_matmul_precision("highest")  # what a fresh worker process would have
        Worker(spec)
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def test_tensor_parallel_size_must_be_positive(hf_checkpoint) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(hf_checkpoint("llama")), tensor_parallel_size=0)


@pytest.mark.parametrize("command", [["serve", "model-dir"], ["generate"], ["bench", "throughput"],
                                     ["bench", "latency"]])
def test_engine_commands_take_the_tensor_parallel_and_load_format_flags(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        governor_main([*command, "--help"])
    assert exited.value.code == 0
    usage = capsys.readouterr().out
    assert "--tensor-parallel-size" in usage and "--load-format" in usage and "--quantization" in usage


def test_a_draft_model_runs_whole_on_rank_0_beside_the_split_target(hf_checkpoint) -> None:
    path = str(hf_checkpoint("qwen3"))
    prompts = mixed_prompts(3, seed=3, hi=20)
    want = tokens(LLM(path, dtype="float32").generate(prompts, greedy(12)))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    with LLM(path, dtype="float32", tensor_parallel_size=2, speculative_config=spec) as llm:
        assert tokens(llm.generate(prompts, greedy(12))) == want
        stats = llm.stats()
        assert llm.engine.spec.proposer.model.tp.size == 1  # type: ignore[union-attr]
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"]


def test_sigusr1_makes_a_worker_print_where_it_waits(hf_checkpoint, capfd: pytest.CaptureFixture[str]) -> None:
    with LLM(str(hf_checkpoint("llama")), dtype="float32", tensor_parallel_size=2) as llm:
        llm.generate([[5, 6, 7]], greedy(2))
        workers = llm.engine.executor._workers
        assert workers is not None
        capfd.readouterr()
        os.kill(workers.pids[0], signal.SIGUSR1)
        deadline = time.monotonic() + 10
        err = ""
        while "in follow" not in err and time.monotonic() < deadline:  # the worker idles in its step loop
            time.sleep(0.1)
            err += capfd.readouterr().err
        assert "in follow" in err and "in serve" in err, err[-2000:]
        assert all(pid_alive(p) for p in workers.pids)  # a stack dump, not an exit


def test_close_ends_every_worker_process(hf_checkpoint) -> None:
    llm = LLM(str(hf_checkpoint("mistral")), dtype="float32", tensor_parallel_size=2)
    workers = llm.engine.executor._workers
    assert workers is not None and len(workers.pids) == 1 and all(pid_alive(p) for p in workers.pids)
    llm.generate([[5, 6, 7]], greedy(2))
    llm.close()
    llm.close()  # idempotent
    assert multiprocessing.active_children() == []
    assert not any(pid_alive(p) for p in workers.pids)
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.generate([[5, 6, 7]], greedy(2))


def test_a_second_tensor_parallel_engine_is_refused_while_one_is_open(hf_checkpoint) -> None:
    path = str(hf_checkpoint("mistral"))
    with LLM(path, tensor_parallel_size=2) as first:
        with pytest.raises(RuntimeError, match="another tensor-parallel engine is open here"):
            LLM(path, tensor_parallel_size=2)
        assert len(multiprocessing.active_children()) == 1  # the refused engine started no worker
        assert first.generate([[5, 6, 7]], greedy(2))[0].outputs[0].finish_reason == "length"


def test_a_start_up_failure_on_every_rank_raises_rank_0s_error_and_leaves_no_worker(hf_checkpoint) -> None:
    with pytest.raises(ValueError, match="fewer than one max_model_len=256 sequence needs"):
        LLM(str(hf_checkpoint("mistral")), tensor_parallel_size=2, num_kv_blocks=2, max_model_len=256)
    assert multiprocessing.active_children() == []


_ORPHAN_SCRIPT = """
import os, signal, sys
from governor.engine import LLM
from governor.engine.cli import main as governor_main
from governor.engine.config import EngineConfig
from governor.engine.executor import resolve_worker_spec
from governor.engine.models.model_config import load_model_config
llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2)
print(llm.engine.executor._workers.pids[0], flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # rank 0 dies without closing anything
"""


def test_a_worker_exits_when_rank_0_dies(hf_checkpoint, tmp_path: Path) -> None:
    from tests.test_server import wait_until

    proc = subprocess.run([sys.executable, "-c", _ORPHAN_SCRIPT, str(hf_checkpoint("mistral"))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    worker = int(proc.stdout.split()[0])
    wait_until(lambda: not pid_alive(worker), f"orphaned worker {worker} to exit", timeout=15)


def test_fp8_kv_scales_are_calibrated_per_rank_for_the_heads_it_holds(tmp_path: Path) -> None:
    # Unscaled weights, as in test_fp8_kv: attention as soft as a real model's.
    path = build_hf_checkpoint(tmp_path, "qwen3", weight_scale=1.0)
    kwargs: dict[str, Any] = dict(dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=64)
    one = LLM(str(path), **kwargs)
    prompt = mixed_prompts(1, seed=5, lo=60, hi=60)[0]
    with LLM(str(path), tensor_parallel_size=2, **kwargs) as two:
        assert two.engine.kv_caches[0][0].shape == (64, 16, 1, 32)  # one of the two KV heads per rank
        assert two.engine.kv_caches[0][0].dtype == torch.float8_e4m3fn
        for a, b in zip(one.engine.model.decoder_layers, two.engine.model.decoder_layers, strict=True):
            # rank 0 holds KV head 0: its scale is the one-rank engine's scale of head 0
            assert a.self_attn.k_scale is not None and b.self_attn.k_scale is not None
            torch.testing.assert_close(b.self_attn.k_scale, a.self_attn.k_scale[:1], rtol=1e-5, atol=0)
        got = two.engine.prompt_logits(prompt, 16)
        gen = tokens(two.generate([prompt], greedy(12)))
    want = one.engine.prompt_logits(prompt, 16)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    assert gen == tokens(one.generate([prompt], greedy(12)))


def test_dummy_weights_are_make_models_and_split_like_loaded_ones(tmp_path: Path) -> None:
    """load_format "dummy" draws what `make-model` writes from the same seed; a config-only directory
    runs on two ranks with the logits of one."""
    written = make_model(tmp_path / "written", "llama", "tiny", dtype="float32", seed=3)
    config_only = make_model(tmp_path / "config-only", "llama", "tiny", dtype="float32", weights=False)
    assert not list(config_only.glob("*.safetensors"))
    prompt = mixed_prompts(1, seed=9, lo=30, hi=30)[0]
    loaded = LLM(str(written)).engine.prompt_logits(prompt)
    drawn = LLM(str(config_only), load_format="dummy", seed=3).engine.prompt_logits(prompt)
    assert torch.equal(drawn, loaded)
    with LLM(str(config_only), load_format="dummy", seed=3, tensor_parallel_size=2) as two:
        torch.testing.assert_close(two.engine.prompt_logits(prompt), loaded, rtol=0, atol=1e-5)
        assert two.engine.model_digest != LLM(str(config_only), load_format="dummy", seed=4).engine.model_digest
    with pytest.raises(FileNotFoundError, match="load_format 'dummy'"):
        LLM(str(config_only))


def test_serve_with_two_ranks_completes_then_drains_and_leaves_no_worker(hf_checkpoint, tmp_path: Path) -> None:
    import httpx  # the server tests' imports stay out of GPU runs, which have no server stack

    from tests.test_server import start_server, wait_until

    with start_server(hf_checkpoint("qwen3"), "--tensor-parallel-size", "2", "--dtype", "float32",
                      "--max-model-len", "256", "--num-kv-blocks", "64", "--served-model-name", "tp",
                      log_dir=tmp_path) as server:
        found = re.search(r"worker pids \[(\d+)\]", server.log_tail())
        assert found, server.log_tail()
        worker = int(found.group(1))
        body = {"model": "tp", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.0,
                "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        server.proc.send_signal(signal.SIGTERM)
        exit_code = server.proc.wait(timeout=30)
    assert exit_code == 0, server.log_tail()
    wait_until(lambda: not pid_alive(worker), "the worker to exit with the server", timeout=10)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_two_ranks_over_nccl_give_the_tokens_of_one(hf_checkpoint) -> None:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity needs true fp32 matmuls
    try:
        for arch in ("llama", "qwen2", "qwen3"):
            path = str(hf_checkpoint(arch))
            prompts = mixed_prompts(6, seed=2)
            kwargs: dict[str, Any] = dict(dtype="float32", device="cuda", max_num_batched_tokens=16)
            want = tokens(LLM(path, **kwargs).generate(prompts, greedy(NEW_TOKENS)))
            with LLM(path, tensor_parallel_size=2, **kwargs) as two:
                assert torch.distributed.get_backend() == "nccl"
                assert tokens(two.generate(prompts, greedy(NEW_TOKENS))) == want
            assert multiprocessing.active_children() == []
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


# --- what rank 0 sends a step, the vocabulary split, async steps, a worker's failure --------------


def record_leads(llm: LLM) -> list[tuple[Any, Any]]:
    """Wrap rank 0's runner's `_lead`: the (shape, extras) of every step it sends the workers."""
    runner = llm.engine.runner
    sent: list[tuple[Any, Any]] = []
    inner = runner._lead

    def lead(shape: Any, extras: Any, feed: Any) -> None:
        sent.append((shape, extras))
        inner(shape, extras, feed)

    runner._lead = lead  # type: ignore[method-assign]
    return sent


def test_a_decode_step_sends_positions_tokens_and_only_the_block_table_entries_that_changed(
        hf_checkpoint) -> None:
    path = str(hf_checkpoint("llama"))
    prompt = mixed_prompts(1, seed=4, lo=21, hi=21)[0]  # 21 tokens: 3 blocks of 8, the last with 5
    kwargs: dict[str, Any] = dict(dtype="float32", block_size=8, num_kv_blocks=32, max_model_len=64,
                                  async_scheduling=False)
    want = tokens(LLM(path, **kwargs).generate([prompt], greedy(12)))
    with LLM(path, tensor_parallel_size=2, **kwargs) as two:
        sent = record_leads(two)
        assert tokens(two.generate([prompt], greedy(12))) == want
    decodes = [(shape, extras) for shape, extras in sent if shape.num_decodes == shape.num_seqs == 1]
    assert len(decodes) == 11
    # Positions 21..31: a step writes at position p; the block of p is new when p % 8 == 0 (p = 24), when the
    # step sends its one new entry: [row 0, start 3, 1 entry, the block].
    assert [(i, e.deltas_len) for i, (_, e) in enumerate(decodes) if e.deltas_len] == [(24 - 21, 4)]
    # The prefill sent its whole table once: 3 blocks.
    assert sent[0][1].deltas_len == 3 + 3


def test_a_vocabulary_that_does_not_split_evenly_is_padded_on_the_last_rank(tmp_path: Path) -> None:
    path = build_hf_checkpoint(tmp_path, "qwen3", vocab_size=2001)  # tied embeddings: one table, split
    prompt = mixed_prompts(1, seed=6, lo=30, hi=30)[0]
    one = LLM(str(path), dtype="float32")
    want_logits = one.engine.prompt_logits(prompt, 16)
    want = tokens(one.generate([prompt], greedy(12)))
    with LLM(str(path), dtype="float32", tensor_parallel_size=2) as two:
        model = two.engine.model
        assert model.vocab_rows == 1001 and model.embed_tokens.shape[0] == 1001
        got = two.engine.prompt_logits(prompt, 16)
        assert got.shape == want_logits.shape == (30, 2001)
        torch.testing.assert_close(got, want_logits, rtol=0, atol=1e-4)
        assert tokens(two.generate([prompt], greedy(12))) == want


def test_async_steps_feed_the_workers_the_sampled_tokens(hf_checkpoint) -> None:
    path = str(hf_checkpoint("qwen2"))
    prompts = mixed_prompts(4, seed=8, hi=30)
    want = tokens(LLM(path, dtype="float32", async_scheduling=False).generate(prompts, greedy(16)))
    with LLM(path, dtype="float32", tensor_parallel_size=2) as two:
        sent = record_leads(two)
        assert tokens(two.generate(prompts, greedy(16))) == want
    fed = [extras.feed_len for _, extras in sent if extras.feed_len]
    assert len(fed) >= 8 and all(n == 4 for n in fed[:8])


def test_a_worker_that_dies_mid_run_ends_the_engine_with_an_error_naming_it(hf_checkpoint) -> None:
    llm = LLM(str(hf_checkpoint("mistral")), dtype="float32", tensor_parallel_size=2)
    workers = llm.engine.executor._workers
    assert workers is not None
    llm.generate([[5, 6, 7]], greedy(2))
    os.kill(workers.pids[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code -9.*is closed"):
        llm.generate([[5, 6, 7, 8]], greedy(64))
    assert llm.engine.executor.closed
    assert multiprocessing.active_children() == []
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.generate([[5, 6, 7]], greedy(2))


class _LoopbackGroup:
    """Rank 0 or 1 of a pretend two-rank group in one process: a broadcast from rank 0 is queued, and rank 1's
    broadcast takes the next one; enough for a leading and a following runner side by side."""

    size = 2

    def __init__(self, rank: int, host: deque[torch.Tensor], device: deque[torch.Tensor]) -> None:
        self.rank, self._host, self._device = rank, host, device

    def broadcast(self, x: torch.Tensor) -> None:
        if self.rank == 0:
            self._host.append(x.clone())
        else:
            x.copy_(self._host.popleft())

    def broadcast_device(self, x: torch.Tensor) -> None:
        if self.rank == 0:
            self._device.append(x.clone())
        else:
            x.copy_(self._device.popleft())


def test_a_follower_rebuilds_every_step_rank_0_sends_and_computes_its_logits_bitwise(hf_checkpoint) -> None:
    """Rank 0's runner leads a follower in this process (same weights, a KV cache of its own) through preemption,
    chunked prefill, prefix-cache hits, n-gram verification and async steps: after every step the follower's
    staged buffers equal rank 0's wherever the step reads them, and its logits are rank 0's, bit for bit (which
    its KV cache, written from what it rebuilt, has to be for that), or its argmax token ids in a greedy step."""
    from governor.engine.runner import ModelRunner

    llm = LLM(str(hf_checkpoint("qwen3")), **STATIC)
    eng = llm.engine
    host_q: deque[torch.Tensor] = deque()
    dev_q: deque[torch.Tensor] = deque()
    leader = eng.runner
    leader.tp = _LoopbackGroup(0, host_q, dev_q)  # type: ignore[assignment]
    cfg = eng.config
    follower = ModelRunner(eng.model, [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in eng.kv_caches],
                           eng.block_size, cfg.tokens_cap, cfg.seqs_cap, eng.max_model_len, eng.device, cfg.spec_cap,
                           _LoopbackGroup(1, host_q, dev_q))  # type: ignore[arg-type]
    follower_logits: list[torch.Tensor] = []
    inner_logits = follower._logits

    def capture(*args: Any) -> torch.Tensor:
        out = inner_logits(*args)
        follower_logits.append(out)
        return out

    follower._logits = capture  # type: ignore[method-assign,assignment]
    inner_execute = leader.execute
    steps = {"fed": 0, "checked": 0, "argmax": 0}

    def execute(out: Any, all_logits: bool = False, feed: torch.Tensor | None = None,
                argmax: bool = False, drafts: torch.Tensor | None = None) -> torch.Tensor:
        logits = inner_execute(out, all_logits, feed, argmax, drafts)
        steps["argmax"] += argmax
        shape = _step_sizes(out)
        assert follower.follow()
        assert not host_q and not dev_q
        a, b = leader.host, follower.host
        t, n, rows = shape["tokens"], shape["logits"], shape["rows"]
        for name in ("positions", "slots"):
            assert np.array_equal(getattr(a, name)[:t], getattr(b, name)[:t]), name
        if feed is None:
            assert np.array_equal(a.input_ids[:t], b.input_ids[:t])
        else:
            steps["fed"] += 1
            assert np.array_equal(a.feed_rows[:n], b.feed_rows[:n])
        assert np.array_equal(a.seq_lens[:rows], b.seq_lens[:rows])
        assert np.array_equal(a.qsl[:rows + 1], b.qsl[:rows + 1])
        assert np.array_equal(a.logits_idx[:n], b.logits_idx[:n])
        for i, s in enumerate(out.scheduled):
            width = len(s.seq.block_table)
            assert np.array_equal(a.block_tables[i, :width], b.block_tables[i, :width]), i
        assert torch.equal(follower_logits[-1], logits)
        steps["checked"] += 1
        return logits

    leader.execute = execute  # type: ignore[method-assign]
    for setup, seed in (("queued", 0), ("chunked", 1), ("speculative", 2), ("default", 3)):
        eng.update_knobs(**SETUPS[setup])
        # n-gram prompts end inside their repeated phrase, so drafts come at once
        prompts = ([{"prompt_token_ids": p} for p in mixed_prompts(6, seed=seed)] if setup != "speculative"
                   else [p[:-1] for p in repetitive_prompts(4, seed=seed)])
        llm.generate(prompts, greedy(NEW_TOKENS))
        llm.generate(prompts[:2], greedy(4))  # prefix-cache hits
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_verification_steps"] > 0
    assert steps["fed"] > 0 and steps["argmax"] > 0 and steps["checked"] > 100


def _step_sizes(out: Any) -> dict[str, int]:
    """The row, token and logits counts of a scheduled step."""
    scheduled = out.scheduled
    tokens = sum(s.num_new_tokens for s in scheduled)
    logits = sum(1 if s.fed_from is not None else s.num_logits for s in scheduled)
    return {"rows": len(scheduled), "tokens": tokens, "logits": logits}
