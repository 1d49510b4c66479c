"""The `governor` command: make-model → generate → bench throughput, end to end on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from governor.cli import main as governor_main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "governor.engine", *args], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "model"
    assert governor_main(["make-model", str(path), "--arch", "llama", "--preset", "tiny", "--dtype", "float32"]) == 0
    return path


def test_generate_prints_one_json_line_per_prompt(tiny_model: Path) -> None:
    proc = run("generate", "--model", str(tiny_model), "--prompt", "hello there", "--prompt", "a b c",
               "--max-tokens", "5", "--max-num-seqs", "2")
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [d["prompt"] for d in lines] == ["hello there", "a b c"]
    assert all(len(d["token_ids"]) <= 5 for d in lines)


def test_bench_throughput_writes_the_experiment_envelope(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = run("bench", "throughput", "--model", str(tiny_model), "--num-prompts", "6", "--input-len", "4:12",
               "--output-len", "3:7", "--max-num-seqs", "4", "--output-json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "output tok/s" in proc.stdout
    env = json.loads(out.read_text())
    r = env["result"]
    assert env["workload"] == {"num_prompts": 6, "input_len": [4, 12], "output_len": [3, 7], "seed": 0,
                               "ignore_eos": True, "prompts": "random token ids"}
    assert 6 * 3 <= r["generated_tokens"] <= 6 * 7
    assert r["engine_settings_non_default"] == {"max_num_seqs": 4}
    assert r["model_digest"].startswith("sha256:") and env["hardware"]["torch"]
    assert r["output_tokens_per_s"] > 0


def test_bench_throughput_hf_backend_runs_the_same_workload(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    proc = run("bench", "throughput", "--model", str(tiny_model), "--num-prompts", "4", "--input-len", "4:12",
               "--output-len", "3:7", "--backend", "hf", "--hf-batch-size", "2", "--output-json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())["result"]
    assert r["backend"] == "hf-transformers-generate" and r["batch_size"] == 2
    assert 4 * 3 <= r["generated_tokens"] <= 4 * 7


def test_unknown_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert governor_main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_bad_engine_argument_is_reported_not_a_traceback(tiny_model: Path) -> None:
    proc = run("generate", "--model", str(tiny_model), "--prompt", "x", "--block-size", "0")
    assert proc.returncode != 0
    assert "block_size" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_prefix_reports_cold_and_warm_ttft_and_divergence(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    proc = run("bench", "prefix", "--model", str(tiny_model), "--system-len", "64", "--suffix-len", "5",
               "--concurrency", "1,3", "--divergence-prompts", "3", "--divergence-tokens", "6", "--block-size", "8",
               "--dtype", "float32", "--output-json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())["result"]
    assert [row["concurrency"] for row in r["ttft"]] == [1, 3]
    assert [row["warm_hit_tokens"] for row in r["ttft"]] == [64, 3 * 64]  # every request hits all 8 blocks
    assert r["divergence"]["identical"] == 3  # fp32 on CPU: a hit never changes the greedy output


def test_bench_kv_compares_fp8_with_model_dtype(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    proc = run("bench", "kv", "--model", str(tiny_model), "--context", "64", "--batches", "2", "--new-tokens", "4",
               "--accuracy-tokens", "16", "--dtype", "float32", "--kv-cache-memory-bytes", "2000000",
               "--output-json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())["result"]
    base, fp8 = r["variants"]["model_dtype"], r["variants"]["fp8"]
    assert fp8["kv_blocks_total"] == 4 * base["kv_blocks_total"]  # fp32 → 1-byte elements
    assert fp8["decode"][0]["decode_tokens"] == 2 * 3  # the first token of each comes from prefill
    assert fp8["decode"][0]["total_s"] > 0 and fp8["decode"][0]["prefill_s"] > 0
    assert r["accuracy"]["positions"] == 16 and 0.0 <= r["accuracy"]["top1_agreement"] <= 1.0


def test_bench_kv_reports_the_weights_and_kv_blocks_of_each_weight_format(tiny_model: Path, tmp_path: Path) -> None:
    """fp8 weights against dense fp32 ones. On CPU the cache is the fixed --kv-cache-memory-bytes, so only the weights
    shrink; on a GPU the cache takes the memory they free (gpu_memory_utilization)."""
    out = tmp_path / "kv.json"
    proc = run("bench", "kv", "--model", str(tiny_model), "--context", "64", "--batches", "2", "--new-tokens", "4",
               "--accuracy-tokens", "8", "--dtype", "float32", "--kv-cache-memory-bytes", "2000000",
               "--weights", "none,fp8", "--output-json", str(out))
    assert proc.returncode == 0, proc.stderr
    w = json.loads(out.read_text())["result"]["weights"]
    assert set(w) == {"none/model_dtype", "none/fp8", "fp8/model_dtype", "fp8/fp8"}
    dense, fp8 = w["none/model_dtype"]["weight_bytes"], w["fp8/model_dtype"]["weight_bytes"]
    assert fp8 < dense  # decoder linears at 1 byte (+ a scale per row) instead of 4
    assert w["fp8/fp8"]["kv_blocks_total"] == 4 * w["fp8/model_dtype"]["kv_blocks_total"]
    assert "MiB of weights" in proc.stdout


def test_the_theoretical_speedup_of_speculation() -> None:
    from governor.engine.bench.spec import theoretical_speedup

    assert theoretical_speedup(1.0, 2, 1.0) == pytest.approx(1.0)  # draft = target: 3 forwards for 3 tokens
    assert theoretical_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / 0.2 / 1.4)  # 2.40: a cheap draft
    assert theoretical_speedup(0.5, 3, 0.0) == pytest.approx(1.875)  # n-gram: free drafts, 1 + .5 + .25 + .125
    assert theoretical_speedup(0.0, 4, 0.2) == pytest.approx(1 / 1.8)  # nothing accepted: the drafts are a loss


def test_bench_spec_sweeps_k_per_batch_and_reports_acceptance(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    proc = run("bench", "spec", "--model", str(tiny_model), "--batches", "1,2", "--ks", "1,2", "--input-len", "8",
               "--output-len", "6", "--perturb-sigma", "", "--ngram", "--dtype", "float32",
               "--output-json", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["result"]["rows"]
    assert [(r["variant"], r["batch"], r["k"]) for r in rows] == [
        (v, b, k) for v in ("draft=target", "ngram") for b in (1, 2) for k in (0, 1, 2)]
    equal = [r for r in rows if r["variant"] == "draft=target" and r["k"] > 0]
    assert all(r["alpha"] == 1.0 for r in equal)  # a draft identical to the target is always accepted
    for r in rows:  # c, the theory and the measured fraction of it, on every row
        c = r["draft_cost_ratio"]
        assert (c == 0.0) if r["variant"] == "ngram" else c > 0  # n-gram proposals run no model
        if r["k"]:
            want = r["expected_tokens_per_step"] / (c * r["k"] + 1)
            assert r["theoretical_speedup"] == pytest.approx(want)
            assert r["fraction_of_theory"] == pytest.approx(r["speedup"] / r["theoretical_speedup"])
    assert all(r["speedup"] == 1.0 for r in rows if r["k"] == 0)


def test_bench_spec_sets_a_separate_drafts_acceptance(tiny_model: Path, tmp_path: Path) -> None:
    """A draft model of its own (another random model, which agrees with the target on next to nothing) under
    controlled acceptance: at 1 every draft is accepted, at 0 none is; its forwards still run, so its cost ratio is
    measured."""
    draft = tmp_path / "draft"
    assert governor_main(["make-model", str(draft), "--arch", "llama", "--preset", "tiny", "--dtype", "float32",
                          "--seed", "7"]) == 0
    out = tmp_path / "spec.json"
    proc = run("bench", "spec", "--model", str(tiny_model), "--batches", "1,2", "--ks", "2", "--input-len", "8",
               "--output-len", "8", "--perturb-sigma", "", "--no-equal-draft", "--draft-model", str(draft),
               "--draft-acceptance", "0,1", "--dtype", "float32", "--output-json", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["result"]["rows"]
    assert [(r["variant"], r["batch"], r["k"]) for r in rows] == [
        (f"draft=draft alpha={a}", b, k) for a in (0.0, 1.0) for b in (1, 2) for k in (0, 2)]
    spec = [r for r in rows if r["k"] == 2]
    assert [(r["controlled_acceptance"], r["alpha"]) for r in spec] == [(0.0, 0.0), (0.0, 0.0), (1.0, 1.0), (1.0, 1.0)]
    assert all(r["tokens_per_step"] == 1.0 for r in spec if r["alpha"] == 0.0)
    assert all(r["tokens_per_step"] > 2.0 for r in spec if r["alpha"] == 1.0)  # 3 a step but where a request ends
    assert all(r["draft_cost_ratio"] > 0 for r in rows)


def test_controlled_acceptance_accepts_each_draft_with_its_probability_then_takes_the_targets_token() -> None:
    from types import SimpleNamespace

    import torch

    from governor.engine.bench.spec import ControlledAcceptance

    greedy = SimpleNamespace(greedy=True, logprobs=None)
    spec = SimpleNamespace(verify=lambda *a: pytest.fail("the engine's own verification is not called"))
    control = ControlledAcceptance(spec, 0.5, seed=3)
    assert spec.verify == control.verify
    # Two sequences: one with drafts [7, 8] (rows 0-2), one without (row 3). Row r's argmax is 10 + r.
    logits = torch.zeros(4, 20)
    logits[torch.arange(4), torch.arange(4) + 10] = 1.0
    sampling = [SimpleNamespace(seq=SimpleNamespace(params=greedy), draft_tokens=[7, 8]),
                SimpleNamespace(seq=SimpleNamespace(params=greedy), draft_tokens=[])]
    counts = [0, 0, 0]
    for _ in range(4000):
        (tokens, lps), (plain, _) = control.verify(sampling, logits, {}, torch.Generator())
        accepted = len(tokens) - 1
        assert tokens == [*[7, 8][:accepted], 10 + accepted] and lps == [None] * len(tokens)
        assert plain == [13]  # no drafts: the row's argmax
        counts[accepted] += 1
    # 0, 1, 2 accepted with probability 1/2, 1/4, 1/4: 2000 / 1000 / 1000 expected (sd 32 / 27 / 27).
    assert 1870 <= counts[0] <= 2130 and 880 <= counts[1] <= 1120 and 880 <= counts[2] <= 1120
    sampled = [SimpleNamespace(seq=SimpleNamespace(params=SimpleNamespace(greedy=False, logprobs=None)),
                               draft_tokens=[7])]
    with pytest.raises(ValueError, match="greedy"):
        control.verify(sampled, logits[:2], {}, torch.Generator())
    with pytest.raises(ValueError, match="within"):
        ControlledAcceptance(SimpleNamespace(verify=None), 1.5)
