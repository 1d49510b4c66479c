"""The peers' benchmarks (benchmarks/peers/): what holds without a GPU and without vLLM — the prompts the vLLM
runner sends are the engine's, the latency runners' arguments and ms/token arithmetic, the error when a peer is
missing, the bundle's parts checked against their manifest, and the summary's ratios."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from benchmarks.peers import (
    bundle,
    decode_timing,
    gpt_fast_latency,
    summary,
    vllm_latency,
    vllm_spec,
    vllm_throughput,
)
from benchmarks.peers.peer import PeerMissing
from benchmarks.peers.vllm_engine import capture_sizes

from governor.engine.models.make_model import make_model


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint benchmarks/peers.sh makes under DRY=1 (qwen3, tiny preset, float32)."""
    return make_model(tmp_path_factory.mktemp("qwen3") / "tiny", "qwen3", "tiny", dtype="float32", seed=0)


def test_vllm_throughput_sends_the_prompt_token_ids_the_engine_runs(tiny_qwen3: Path) -> None:
    from governor.engine import LLM
    from governor.engine.bench.throughput import Workload

    args = vllm_throughput.parse_args(["--model", str(tiny_qwen3), "--num-prompts", "8", "--input-len", "5:12",
                                       "--output-len", "3:9", "--workload-seed", "7"])
    workload = vllm_throughput.workload_of(args)
    assert workload == Workload(8, (5, 12), (3, 9), 7)
    with LLM(str(tiny_qwen3), device="cpu", dtype="float32") as llm:  # the vocabulary as the engine's run takes it
        eng = llm.engine
        expected = workload.make(min(eng.model_config.vocab_size, len(eng.tokenizer)))
    assert vllm_throughput.engine_prompts(str(tiny_qwen3), workload) == expected


def test_vllm_throughput_settings_are_the_engines_defaults_with_graphs_up_to_the_batch(tiny_qwen3: Path) -> None:
    args = vllm_throughput.parse_args(["--model", str(tiny_qwen3), "--kv-cache-dtype", "fp8"])
    settings = vllm_throughput.llm_settings(args)
    assert settings["kv_cache_dtype"] == "fp8"
    assert (settings["max_num_seqs"], settings["max_num_batched_tokens"], settings["gpu_memory_utilization"]) == (
        256, 8192, 0.9)
    assert "max_model_len" not in settings  # the checkpoint's, as the engine's
    assert settings["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]}
    assert "quantization" not in settings  # the checkpoint's own
    fp8 = vllm_throughput.llm_settings(vllm_throughput.parse_args(["--model", str(tiny_qwen3),
                                                                   "--quantization", "fp8"]))
    assert fp8["quantization"] == "fp8"  # weights quantized at load, as the engine's --quantization fp8


def test_vllm_spec_sets_acceptance_as_the_engines_benchmark_does(tiny_qwen3: Path) -> None:
    """Each draft accepted with probability alpha in order: vLLM's unconditional per-position rates are alpha^(i+1);
    K = 0 runs without speculation, every engine holds the largest batch and reports its counters."""
    assert vllm_spec.synthetic_rates(0.8, 4) == pytest.approx([0.8, 0.64, 0.512, 0.4096])
    args = vllm_spec.parse_args(["--model", str(tiny_qwen3), "--draft-model", "/d", "--batches", "1,8",
                                 "--ks", "4,0,2", "--draft-acceptance", "0.5"])
    assert args.ks == [2, 4] and args.batches == [1, 8]
    plain, deep = vllm_spec.llm_settings(args, 0), vllm_spec.llm_settings(args, 4)
    assert "speculative_config" not in plain and plain["max_num_seqs"] == 8 and plain["disable_log_stats"] is False
    assert plain["compilation_config"]["cudagraph_capture_sizes"][-1] == 8  # a decode step of 8 sequences
    assert deep["compilation_config"]["cudagraph_capture_sizes"][-1] == 40  # a verification of 8 x (4 + 1) tokens
    assert deep["speculative_config"] == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 4,
                                          "rejection_sample_method": "synthetic",
                                          "synthetic_acceptance_rates": [0.5, 0.25, 0.125, 0.0625]}
    fp8 = vllm_spec.parse_args(["--model", str(tiny_qwen3), "--draft-model", "/d", "--draft-quantization", "fp8"])
    assert vllm_spec.llm_settings(fp8, 2)["speculative_config"]["quantization"] == "fp8"
    assert "quantization" not in vllm_spec.llm_settings(fp8, 0)  # the target keeps its weights
    with pytest.raises(SystemExit):
        vllm_spec.parse_args(["--model", "m", "--draft-model", "d", "--draft-acceptance", "1.5"])


def test_vllm_spec_runs_each_depth_in_its_own_process_and_divides_by_plain_decoding(
        tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent starts one child per K (the same arguments, `--only-k K`, its own output file) and reports each
    row's rate over the K = 0 rate of its batch."""
    calls: list[list[str]] = []
    rates = {(0, 1): 100.0, (0, 8): 400.0, (2, 1): 150.0, (2, 8): 300.0}

    def child(cmd: list[str]) -> None:
        calls.append(cmd)
        k = int(cmd[cmd.index("--only-k") + 1])
        rows = [{"k": k, "batch": b, "output_tok_s": rates[(k, b)], "vllm": "0.26.0"} for b in (1, 8)]
        Path(cmd[cmd.index("--output-json") + 1]).write_text(json.dumps(rows))

    monkeypatch.setattr(vllm_spec, "run_child", child)
    out = tmp_path / "spec.json"
    argv = ["--model", str(tiny_qwen3), "--draft-model", "/d", "--batches", "1,8", "--ks", "2",
            "--output-json", str(out)]
    assert vllm_spec.main(argv) == 0
    assert [c[c.index("--only-k") + 1] for c in calls] == ["0", "2"]
    assert all(c.count("--output-json") == 1 and str(out) not in c for c in calls)
    rows = json.loads(out.read_text())["result"]["rows"]
    assert {(r["k"], r["batch"]): r["speedup"] for r in rows} == {(0, 1): 1.0, (0, 8): 1.0, (2, 1): 1.5,
                                                                  (2, 8): 0.75}


def test_capture_sizes_are_the_powers_of_two_below_the_batch_and_the_batch() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(24) == [1, 2, 4, 8, 16, 24]
    with pytest.raises(ValueError, match="at least 1"):
        capture_sizes(0)


def test_vllm_runners_say_how_to_get_vllm_when_it_is_missing(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    out = tmp_path / "thr.json"
    with pytest.raises(PeerMissing, match=r"vLLM 0\.26\.0 is not importable: unpack the bundle") as e:
        vllm_throughput.main(["--model", str(tiny_qwen3), "--num-prompts", "2", "--output-json", str(out)])
    assert "benchmarks.peers.bundle install" in str(e.value.code)
    assert not out.exists()
    with pytest.raises(PeerMissing, match="is not importable"):
        vllm_latency.main(["--model", str(tiny_qwen3), "--context", "16", "--new-tokens", "4"])
    if "flashinfer" not in sys.modules:  # vLLM then samples without FlashInfer
        assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_vllm_latency_runs_one_sequence_with_batch_1_graphs_and_the_engines_lengths(tiny_qwen3: Path) -> None:
    args = vllm_latency.parse_args(["--model", str(tiny_qwen3)])
    assert (args.context, args.new_tokens, args.max_model_len, args.load_format) == (512, 128, 4096, "dummy")
    settings = vllm_latency.llm_settings(args)
    assert settings["max_num_seqs"] == 1
    assert settings["compilation_config"] == {"cudagraph_capture_sizes": [1]}
    assert settings["load_format"] == "dummy"


@pytest.mark.parametrize(("argv", "message"), [
    (["--new-tokens", "1"], "no decode step"),
    (["--context", "4000", "--new-tokens", "128"], "exceed --max-model-len 4096"),
])
def test_vllm_latency_rejects_lengths_that_cannot_be_timed(argv: list[str], message: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        vllm_latency.parse_args(["--model", "m", *argv])
    assert message in capsys.readouterr().err


def test_gpt_fast_latency_defaults_to_the_llama3_8b_shape_in_bf16() -> None:
    args = gpt_fast_latency.parse_args(["--gpt-fast-dir", "gf"])
    assert (args.weights, args.model_name, args.context, args.new_tokens) == ("bf16", "llama-3-8b", 512, 128)
    assert (args.temperature, args.top_k) == (0.8, 200)  # gpt-fast generate.py's
    assert gpt_fast_latency.parse_args(["--gpt-fast-dir", "gf", "--weights", "int8"]).weights == "int8"
    assert gpt_fast_latency.parse_args(["--gpt-fast-dir", "gf", "--weights", "int4"]).weights == "int4"
    with pytest.raises(SystemExit):
        gpt_fast_latency.parse_args(["--gpt-fast-dir", "gf", "--weights", "int2"])


def test_gpt_fast_latency_says_where_to_get_gpt_fast_when_the_checkout_is_missing(tmp_path: Path) -> None:
    with pytest.raises(PeerMissing, match=r"gpt-fast is not importable.*has no generate\.py"):
        gpt_fast_latency.main(["--gpt-fast-dir", str(tmp_path), "--plan"])


def test_decode_steps_are_host_time_between_token_arrivals_split_over_tokens_brought_together() -> None:
    arrivals = [(10.0, 1), (10.010, 1), (10.030, 2), (10.036, 1)]
    assert decode_timing.decode_steps(arrivals) == pytest.approx([0.010, 0.010, 0.010, 0.006])
    with pytest.raises(ValueError, match="brought 0 tokens"):
        decode_timing.decode_steps([(1.0, 1), (2.0, 0)])


def test_latency_row_has_the_engines_keys_and_statistics() -> None:
    row = decode_timing.latency_row(1, 512, 5, 0.050, [0.010, 0.006, 0.010, 0.010])
    assert row == {"batch": 1, "context": 512, "new_tokens": 5, "ttft_ms": pytest.approx(50.0), "decode_steps": 4,
                   "ms_per_token_mean": pytest.approx(9.0), "ms_per_token_p50": pytest.approx(10.0),
                   "ms_per_token_p90": pytest.approx(10.0), "decode_tok_s": pytest.approx(4 / 0.036)}
    with pytest.raises(ValueError, match="no decode step"):
        decode_timing.latency_row(1, 512, 1, 0.05, [])


def _fake_bundle(tmp_path: Path) -> tuple[Path, Path]:
    """A site of two files packed and split into 3 parts under tmp_path/peers; (site, peers dir)."""
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("VERSION = '1'\n")
    (site / "pkg" / "blob.bin").write_bytes(os.urandom(5000))  # random: xz leaves it about as large
    peers = tmp_path / "peers"
    peers.mkdir()
    archive = tmp_path / bundle.ARCHIVE
    bundle.pack(site, archive)
    parts = bundle.split(archive, peers, part_max=2048)
    assert [p.relative_to(peers).as_posix() for p in parts] == [f"vllm-{i}/{bundle.ARCHIVE}.{i}" for i in (1, 2, 3)]
    assert all(p.stat().st_size <= 2048 for p in parts)
    return site, peers


def test_bundle_install_unpacks_the_parts_it_checked(tmp_path: Path) -> None:
    site, peers = _fake_bundle(tmp_path)
    target = bundle.install(peers, tmp_path / "unpacked")
    for f in ("pkg/__init__.py", "pkg/blob.bin"):
        assert (target / f).read_bytes() == (site / f).read_bytes()
    assert (peers / "vllm-2" / bundle.MANIFEST).read_text() == (peers / "vllm-1" / bundle.MANIFEST).read_text()


def test_bundle_install_rejects_a_corrupted_part(tmp_path: Path) -> None:
    _, peers = _fake_bundle(tmp_path)
    part = peers / "vllm-2" / f"{bundle.ARCHIVE}.2"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(bundle.BundleError, match=rf"part vllm-2/{bundle.ARCHIVE}\.2 is corrupt"):
        bundle.install(peers, tmp_path / "unpacked")
    assert not (tmp_path / "unpacked").exists()


def test_bundle_install_names_a_missing_part(tmp_path: Path) -> None:
    _, peers = _fake_bundle(tmp_path)
    (peers / "vllm-3" / f"{bundle.ARCHIVE}.3").unlink()
    with pytest.raises(bundle.BundleError, match=rf"part vllm-3/{bundle.ARCHIVE}\.3 is missing"):
        bundle.install(peers, tmp_path / "unpacked")


def test_bundle_prune_fails_when_the_wheel_no_longer_has_a_path(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_fa2.so").write_bytes(b"x" * 10)
    assert bundle.prune(tmp_path, ["vllm/_fa2.so"]) == 10
    with pytest.raises(bundle.BundleError, match="review PRUNE"):
        bundle.prune(tmp_path, ["vllm/_fa2.so"])


def _write(folder: Path, name: str, result: dict[str, object]) -> None:
    (folder / name).write_text(json.dumps({"benchmark": "x", "result": result}))


def test_summary_puts_each_peer_beside_the_engine_with_ratios(tmp_path: Path) -> None:
    _write(tmp_path, "thr-governor.json", {"output_tokens_per_s": 30000.0})
    _write(tmp_path, "thr-vllm.json", {"output_tokens_per_s": 20000.0})
    _write(tmp_path, "latency-governor.json", {"rows": [{"batch": 1, "ms_per_token_p50": 5.0}]})
    _write(tmp_path, "latency-vllm.json", {"rows": [{"batch": 1, "ms_per_token_p50": 6.5}]})
    lines = summary.summarize(tmp_path).splitlines()
    assert lines[2].split() == ["KV", "bf16", "30,000", "20,000", "1.50x", "-", "-"]
    assert lines[3].split() == ["KV", "fp8", "-", "-", "-", "-", "-"]  # stages skipped
    assert lines[5].split() == ["Governor", "5.00"]
    assert lines[6].split() == ["vLLM", "6.50", "1.30x"]
    assert lines[7].split() == ["gpt-fast", "bf16", "-", "-"]
