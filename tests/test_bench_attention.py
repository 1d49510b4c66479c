"""`governor bench attention` and the hf backend's options of `bench throughput`, on CPU at tiny shapes.

The kernels run under Triton's interpreter (tests/conftest.py); timings are meaningless here, so these
tests check the bytes formula, the split count reported, the result's shape, the CLI and that the hf
options run (batch limit, batch warm-up, progress log) and say when a figure is extrapolated.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from governor.cli import main as governor_main
from governor.engine.bench import attention as ba
from governor.engine.bench.throughput import HFOptions, Workload, run_hf
from governor.kernels.elementwise import INTERPRET
from governor.kernels.launch_policy import LaunchPolicy

needs_triton = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                  reason="no CUDA and TRITON_INTERPRET is not 1")


def test_kv_bytes_counts_k_and_v_once_per_token_and_head() -> None:
    case = ba.AttentionCase(batch=32, context=4096, num_q_heads=32, num_kv_heads=8, head_dim=128)
    assert ba.kv_bytes(case) == 2 * 32 * 4096 * 8 * 128 * 2  # 512 MiB of bf16
    fp8 = ba.AttentionCase(32, 4096, 32, 8, 128, kv_dtype="fp8")
    assert ba.kv_bytes(fp8) == 2 * 32 * 4096 * 8 * 128 + 2 * 8 * 4  # 1 byte each, plus the per-head scales


def test_reported_split_count_is_the_kernels() -> None:
    cpu = torch.device("cpu")
    # Auto on a 132-SM part: 3 * 132 programs wanted over 32 * 8 (seq, kv head) pairs -> 2 splits of 2048 tokens;
    # over 16 * 8 pairs -> 4 splits of 1024.
    assert ba.effective_num_splits(ba.AttentionCase(32, 4096, 32, 8, 128), cpu) == 2
    assert ba.effective_num_splits(ba.AttentionCase(16, 4096, 32, 8, 128), cpu) == 4
    # An fp8 cache fits one wave of 4 programs per SM: 2 splits at batch 32 (512 of 528), 4 at batch 16.
    assert ba.effective_num_splits(ba.AttentionCase(32, 4096, 32, 8, 128, kv_dtype="fp8"), cpu) == 2
    assert ba.effective_num_splits(ba.AttentionCase(16, 8192, 32, 8, 128, kv_dtype="fp8"), cpu) == 4
    assert ba.effective_num_splits(ba.AttentionCase(32, 4096, 32, 8, 128, num_splits=1), cpu) == 1
    # 100 tokens in blocks of 16 -> a 112-token table; 4 splits of 28 round up to 64-token partitions -> 2.
    assert ba.effective_num_splits(ba.AttentionCase(1, 100, 4, 2, 16, num_splits=4), cpu) == 2


def test_parse_cases_is_the_cross_product() -> None:
    cases = ba.parse_cases("1,2", "64", "4:2", 16, "bf16,fp8", 16, "auto,1", "random,contiguous")
    assert len(cases) == 2 * 2 * 2 * 2
    assert {c.num_splits for c in cases} == {None, 1} and {c.table for c in cases} == {"random", "contiguous"}
    with pytest.raises(ValueError, match="unknown KV dtype"):
        ba.parse_cases("1", "64", "4:2", 16, "int4", 16, "auto", "random")


@needs_triton
def test_bench_attention_rows_on_cpu() -> None:
    cases = [ba.AttentionCase(2, 80, 4, 2, 16, kv_dtype=kvd, num_splits=s, table=t)
             for kvd, s, t in (("bf16", None, "random"), ("fp8", 2, "contiguous"))]
    seen: list[int] = []
    result = ba.bench_attention(cases, device="cpu", warmup=1, iters=2, on_row=lambda p: seen.append(len(p["rows"])))
    assert seen == [1, 2]
    assert result["info"]["hbm_copy_gb_per_s"] is None and result["info"]["device"] == "cpu"
    auto, split = result["rows"]
    assert auto["kv_bytes"] == 2 * 2 * 80 * 2 * 16 * 2 and auto["us_p50"] > 0 and auto["kv_gb_per_s"] > 0
    assert split["num_splits_run"] == 2 and split["kv_dtype"] == "fp8" and split["table"] == "contiguous"
    assert "fraction_of_hbm" not in auto  # no HBM figure off the GPU


@needs_triton
def test_cli_bench_attention_writes_an_envelope(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "attention.json"
    assert governor_main(["bench", "attention", "--device", "cpu", "--batches", "2", "--contexts", "48",
                          "--heads", "4:2", "--head-dim", "16", "--kv-dtypes", "bf16", "--splits", "auto,1",
                          "--warmup", "1", "--iters", "2", "--output-json", str(out)]) == 0
    env = json.loads(out.read_text())
    assert env["benchmark"] == "bench-attention" and env["hardware"]["torch"]
    assert "2 * batch * context" in env["kv_bytes_formula"]
    assert [r["num_splits"] for r in env["result"]["rows"]] == [None, 1]
    assert capsys.readouterr().out.count(" us p50") == 2


def test_hf_options_time_a_subset_and_say_so(hf_checkpoint, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(hf_checkpoint("qwen3"))
    workload = Workload(num_prompts=4, input_len=(5, 5), output_len=(6, 6))
    opts = HFOptions(attn_implementation="sdpa", max_batches=1, warmup_tokens=2, progress_every=3)
    r = run_hf(model, workload, "float32", "cpu", 2, opts)
    assert r["batches_timed"] == 1 and r["batches_total"] == 2 and r["extrapolated"] is True
    assert r["generated_tokens"] == 2 * 6 and r["workload_generated_tokens"] == 4 * 6
    assert r["elapsed_s_extrapolated_to_workload"] == pytest.approx(2 * r["elapsed_s"])
    assert r["attn_implementation"] == "sdpa" and r["options"]["max_batches"] == 1
    assert "batch 0: 3 tokens at" in capsys.readouterr().out
    plain = run_hf(model, workload, "float32", "cpu", 2)
    assert "extrapolated" not in plain and plain["generated_tokens"] == 4 * 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_time_call_leaves_the_hosts_time_out_of_the_events(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each call spends 2 ms on the host before a tiny kernel. Enqueued right after one another, a GPU that has
    # caught up would wait those 2 ms between the call's events; enqueued while the GPU sleeps, it does not. One
    # try per chunk: the first sleep must already cover the host (a retry would raise here).
    monkeypatch.setattr(ba, "_SLEEP_TRIES", 1)
    x = torch.zeros(1024, device="cuda")

    def call() -> None:
        time.sleep(0.002)
        x.add_(1)

    times = ba.time_call(call, torch.device("cuda"), 2, 70)  # two chunks
    assert len(times) == 70
    assert max(times) < 0.5, times  # ms: the kernel's few microseconds plus launch latency, not 2 ms
    assert float(x[0]) == 2 + 1 + 70  # warm-up, the host measurement, the timed calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_time_call_refuses_timings_the_host_got_into(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ba, "_SLEEP_CYCLES_PER_S", 0.0)  # no sleep: the GPU keeps up with a 2 ms host
    x = torch.zeros(1, device="cuda")

    def call() -> None:
        time.sleep(0.002)
        x.add_(1)

    with pytest.raises(RuntimeError, match="caught up with the host"):
        ba.time_call(call, torch.device("cuda"), 1, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_times_sum_a_calls_kernels_without_the_gaps_between_them() -> None:
    # Two kernels per call with 2 ms of host time between them: their summed durations, not the 2 ms.
    a, b = torch.zeros(2**24, device="cuda"), torch.zeros(2**24, device="cuda")

    def call() -> None:
        a.add_(1)
        time.sleep(0.002)
        b.add_(2)

    times = ba.kernel_times(call, torch.device("cuda"), 6)
    assert len(times) == 6
    assert all(0 < t < 500 for t in times), times  # us: two 64 MiB read-writes, tens of us each
    assert float(a[0]) == 7 and float(b[0]) == 14  # the probe call and the 6 timed ones


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_attention_rows_report_the_kernels_alone_beside_the_events() -> None:
    case = ba.AttentionCase(32, 4096, 32, 8, 128, "fp8")
    row = ba.bench_case(case, torch.bfloat16, torch.device("cuda"), 3, 10, 4000.0)
    assert 0 < row["kernel_us_p50"] <= row["us_p50"]
    assert row["fraction_of_hbm_kernels"] == pytest.approx(row["kernel_gb_per_s"] / 4000.0)


def test_the_attention_ab_scripts_variants_set_settings_the_kernel_module_has() -> None:
    # scripts/decode-attention-ab.py replaces each variant's fields of the launch policy; a renamed one would fail on
    # the GPU.
    spec = importlib.util.spec_from_file_location("decode_attention_ab", Path(__file__).parents[1] / "scripts" /
                                                  "decode-attention-ab.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    names = {name for group in script.GROUPS.values() for v in group.values() for name in v}
    # Each name is a field of LaunchPolicy, the launch settings the kernels read.
    assert names and names <= {f.name for f in dataclasses.fields(LaunchPolicy)}, names
