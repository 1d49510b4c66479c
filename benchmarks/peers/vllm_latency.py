"""vLLM's batch-1 decode latency, measured as `governor bench latency` measures the engine's:

    python3 -m benchmarks.peers.vllm_latency --model DIR --context 512 --new-tokens 128 --output-json lat-vllm.json

DIR is a config-only checkpoint (`governor make-model DIR --arch llama --preset llama3-8b --no-weights`): vLLM
draws random weights of its shape (load_format "dummy"), as the engine does. One request of `--context` random
token ids (drawn as the engine's benchmark draws them: the same seed, the engine's vocabulary) is added to vLLM's
LLMEngine, and `step()` is called until it finishes; each step returns the tokens the engine core produced since
the last (RequestOutputKind.DELTA), so the host time between two steps that bring tokens is one decode step's
time, as in the engine's benchmark, whose steps end with the sampled ids on the host (`decode_timing`). The first
token ends TTFT; every later one is a decode step; the row reports p50, mean and p90 of ms per token. A warm-up
request of 8 new tokens goes first, untimed, as in the engine's benchmark. vLLM runs as users run it (engine core
in its own process, torch.compile, CUDA graphs, captured here at batch 1 only, FlashAttention 3 on an H100).
`--plan` prints the settings without importing vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

from benchmarks.peers.decode_timing import check_new_tokens, decode_steps, latency_row
from benchmarks.peers.peer import engine_vocab, write_result
from benchmarks.peers.vllm_engine import capture_sizes, import_vllm

from governor.engine.bench.cache import random_ids


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.peers.vllm_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a checkpoint directory (config.json and tokenizer suffice)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated, the first included")
    p.add_argument("--load-format", default="dummy", help="dummy: random weights from config.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--quantization", default=None, choices=("fp8",),
                   help="fp8: vLLM quantizes the dense weights at load (a pre-quantized config.json needs nothing)")
    p.add_argument("--max-model-len", type=int, default=4096, help="as the engine's latency run")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plan", action="store_true", help="print the settings, run nothing")
    args = p.parse_args(argv)
    check_new_tokens(p, args.new_tokens)
    if args.context + args.new_tokens > args.max_model_len:
        p.error(f"--context {args.context} + --new-tokens {args.new_tokens} exceed --max-model-len "
                f"{args.max_model_len}")
    return args


def llm_settings(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's `LLM(...)` keyword arguments: one sequence at a time, CUDA graphs of batch 1."""
    return {"model": args.model, "load_format": args.load_format, "dtype": args.dtype,
            "kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.max_model_len, "seed": args.seed,
            "max_num_seqs": 1, "gpu_memory_utilization": args.gpu_memory_utilization,
            "tensor_parallel_size": args.tensor_parallel_size,
            "compilation_config": {"cudagraph_capture_sizes": capture_sizes(1)},
            **({"quantization": args.quantization} if args.quantization else {})}


def timed_request(vllm: Any, engine: Any, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """Run one request through `engine.step()`; its latency row."""
    from vllm.sampling_params import RequestOutputKind

    params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                                 output_kind=RequestOutputKind.DELTA)
    rid = f"latency-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    arrivals: list[tuple[float, int]] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs if o.request_id == rid)
        if tokens:
            arrivals.append((now, tokens))
    if not arrivals:
        raise RuntimeError("vLLM finished the request without returning a token")
    return latency_row(1, len(prompt), new_tokens, arrivals[0][0] - t0, decode_steps(arrivals))


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    vocab = engine_vocab(args.model)
    settings = llm_settings(args)
    vllm = import_vllm()
    t_start = time.perf_counter()
    llm = vllm.LLM(**settings)
    start_s = time.perf_counter() - t_start
    engine = llm.llm_engine
    # As the engine's benchmark: a short warm-up request first, then the timed one, each prompt from one rng.
    timed_request(vllm, engine, random_ids(rng, vocab, args.context), min(args.new_tokens, 8))
    row = timed_request(vllm, engine, random_ids(rng, vocab, args.context), args.new_tokens)
    info = {"peer": "vllm", "vllm": vllm.__version__, "settings": settings, "start_s": start_s,
            "env": {"VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")}}
    return write_result("bench-latency", args.model, {"rows": [row], "engine": info}, args.output_json)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        print(json.dumps({"vocab": engine_vocab(args.model), "llm": llm_settings(args)}))
        return 0
    row = run(args)["result"]["rows"][0]
    print(f"vLLM batch 1 at {row['context']} context: {row['ms_per_token_p50']:.2f} ms/token p50 "
          f"(mean {row['ms_per_token_mean']:.2f}), TTFT {row['ttft_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
