"""vLLM's speculative decoding with a draft model on the workload of `governor bench spec`, acceptance set by vLLM's
own synthetic rejection sampling:

    python3 -m benchmarks.peers.vllm_spec --model TARGET --draft-model DRAFT --batches 1,8 --ks 2,4 \\
        --input-len 32 --output-len 128 --draft-acceptance 0.8 --output-json spec-vllm.json

TARGET and DRAFT are checkpoints of one vocabulary (e.g. `governor make-model` presets llama3-8b and llama3.2-1b),
random weights drawn by vLLM (load_format "dummy", both models). Two random models agree on next to nothing, so, as
the engine's `--draft-acceptance` does, vLLM decides acceptance itself: `rejection_sample_method="synthetic"` with
the unconditional per-position rates alpha^(i+1) (each draft accepted with probability alpha, in order, until the
first rejection), while the draft's forwards and the target's verification run as they would. For K = 0 and each K
one vLLM engine is started (its speculative config is fixed at start); each point is one greedy batch of `batch`
prompts of `--input-len` random token ids (drawn as the engine's benchmark draws them: the same seeds, the engine's
vocabulary), `--output-len` new tokens each with ignore_eos, timed from `generate` to its return, prefill included,
after an untimed warm-up batch, as `governor bench spec` times its rows. Each engine runs in a process of its own
(`--only-k`), so that the next one starts with the whole GPU. Rows report output tokens/s, the speedup over K = 0 at
the same batch and, from vLLM's spec-decode counters, the acceptance at the first position and the tokens per
verification step. `--plan` prints the engines' settings without importing vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.peer import engine_vocab, write_result
from benchmarks.peers.vllm_engine import capture_sizes, import_vllm

from governor.engine.bench.cache import random_ids

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.peers.vllm_spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the target checkpoint (config.json and tokenizer suffice)")
    p.add_argument("--draft-model", required=True, help="the draft checkpoint, of the target's vocabulary")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--ks", default="2,4", help="comma-separated speculation depths (K = 0 always runs)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--draft-acceptance", type=float, default=0.8, help="alpha: each draft's acceptance, in order")
    p.add_argument("--draft-quantization", default=None, help="the draft's weight quantization (speculative_config's "
                   "'quantization'; 'fp8' quantizes an unquantized draft at load), as the engine's benchmark sets it")
    p.add_argument("--load-format", default="dummy", help="dummy: random weights from config.json (both models)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096, help="as the engine's run")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plan", action="store_true", help="print the engines' settings, run nothing")
    p.add_argument("--only-k", type=int, default=None, help=argparse.SUPPRESS)  # one engine's rows, for the parent
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.ks = sorted({int(k) for k in args.ks.split(",")} - {0})
    if not 0.0 <= args.draft_acceptance <= 1.0:
        p.error(f"--draft-acceptance must be in [0, 1], got {args.draft_acceptance}")
    if any(b < 1 for b in args.batches) or any(k < 1 for k in args.ks):
        p.error("--batches and --ks take positive integers")
    return args


def synthetic_rates(alpha: float, k: int) -> list[float]:
    """vLLM's unconditional per-position acceptance rates for drafts each accepted with probability alpha, in order
    until the first rejection: position i is accepted with all before it, alpha^(i+1)."""
    return [alpha ** (i + 1) for i in range(k)]


def llm_settings(args: argparse.Namespace, k: int) -> dict[str, Any]:
    """vLLM's `LLM(...)` keyword arguments at speculation depth k (0: no speculation)."""
    settings: dict[str, Any] = {
        "model": args.model, "load_format": args.load_format, "dtype": args.dtype,
        "max_model_len": args.max_model_len, "seed": args.seed, "max_num_seqs": max(args.batches),
        "gpu_memory_utilization": args.gpu_memory_utilization, "disable_log_stats": False,
        # Graphs up to a verification's tokens at the largest batch (vLLM rounds each size up to a multiple of K + 1).
        "compilation_config": {"cudagraph_capture_sizes": capture_sizes(max(args.batches) * (k + 1))},
    }
    if k:
        settings["speculative_config"] = {
            "method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k,
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": synthetic_rates(args.draft_acceptance, k)}
        if args.draft_quantization:
            settings["speculative_config"]["quantization"] = args.draft_quantization
    return settings


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's spec-decode counters now: drafts, draft tokens, accepted tokens, and accepted tokens by position."""
    out: dict[str, Any] = {name: 0 for name in COUNTERS} | {PER_POSITION: []}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[metric.name] = int(metric.value)
        elif metric.name == PER_POSITION:
            out[PER_POSITION] = list(metric.values)
    return out


def generation_rate(vllm: Any, llm: Any, vocab: int, batch: int, input_len: int, output_len: int, seed: int
                    ) -> float:
    """Output tokens/s of one greedy batch, prefill included (as `governor bench spec`)."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": random_ids(rng, vocab, input_len)} for _ in range(batch)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def engine_rows(args: argparse.Namespace, k: int) -> list[dict[str, Any]]:
    """One vLLM engine at depth k: its rate at every batch, with its spec-decode counters' acceptance."""
    vllm = import_vllm()
    vocab = engine_vocab(args.model)
    t_start = time.perf_counter()
    llm = vllm.LLM(**llm_settings(args, k))
    start_s = time.perf_counter() - t_start
    generation_rate(vllm, llm, vocab, 2, args.input_len, 4, seed=0)  # warm-up
    rows = []
    for batch in args.batches:
        before = spec_counters(llm)
        rate = generation_rate(vllm, llm, vocab, batch, args.input_len, args.output_len, seed=batch)
        after = spec_counters(llm)
        drafts = after[COUNTERS[0]] - before[COUNTERS[0]]
        accepted = after[COUNTERS[2]] - before[COUNTERS[2]]
        first = (after[PER_POSITION][:1] or [0])[0] - (before[PER_POSITION][:1] or [0])[0]
        rows.append({"variant": "vllm draft model, synthetic acceptance" if k else "vllm plain", "batch": batch,
                     "k": k, "output_tok_s": rate, "draft_acceptance": args.draft_acceptance if k else None,
                     "alpha": first / drafts if drafts else 0.0,
                     "tokens_per_step": 1 + accepted / drafts if drafts else 1.0, "drafts": drafts,
                     "start_s": start_s, "vllm": vllm.__version__})
    return rows


def with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its speedup over the K = 0 row of its batch."""
    base = {r["batch"]: r["output_tok_s"] for r in rows if r["k"] == 0}
    return [r | {"speedup": r["output_tok_s"] / base[r["batch"]] if base.get(r["batch"]) else None} for r in rows]


def run_child(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True)


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in [0, *args.ks]:
            out = Path(tmp) / f"k{k}.json"
            run_child([sys.executable, "-m", "benchmarks.peers.vllm_spec", *argv, "--only-k", str(k),
                       "--output-json", str(out)])
            rows += json.loads(out.read_text())
    rows = with_speedups(rows)
    for row in rows:
        print(json.dumps(row), flush=True)
    info = {"peer": "vllm", "vllm": rows[0]["vllm"] if rows else None,
            "settings": [llm_settings(args, k) for k in [0, *args.ks]],
            "env": {"VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")},
            "input_len": args.input_len, "output_len": args.output_len}
    return write_result("bench-spec", args.model, {"rows": rows, "engine": info}, args.output_json)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.plan:
        print(json.dumps({"vocab": engine_vocab(args.model), "llm": [llm_settings(args, k) for k in [0, *args.ks]]}))
        return 0
    if args.only_k is not None:
        Path(args.output_json).write_text(json.dumps(engine_rows(args, args.only_k)))
        return 0
    parent = [a for i, a in enumerate(argv) if not a.startswith("--output-json")
              and (i == 0 or argv[i - 1] != "--output-json")]
    run(args, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
