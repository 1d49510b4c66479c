"""vLLM's offline throughput on the workload of `governor bench throughput`:

    python3 -m benchmarks.peers.vllm_throughput --model DIR --num-prompts 256 --input-len 100:100 \\
        --output-len 1024:1024 [--kv-cache-dtype auto|fp8] [--quantization fp8] --output-json thr-vllm.json

The prompts are the engine's own token ids (`Workload.make` over the vocabulary the engine draws from), every
request greedy with ignore_eos, as the engine's run; vLLM gets the engine's defaults where both have the setting
(max_num_seqs 256, max_num_batched_tokens 8192, gpu_memory_utilization 0.9, max_model_len from the checkpoint) and
its own otherwise (torch.compile, CUDA graphs, FlashAttention 3 on an H100), with CUDA graphs captured only up to
max_num_seqs (`vllm_engine.capture_sizes`). As the engine's run, a 2-prompt warm-up goes untimed first; the
result is output tokens over the wall time of one `generate` of all prompts, in the engine's JSON envelope.
`--plan` prints the prompts' shape and vLLM's settings without importing vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from benchmarks.peers.peer import engine_vocab, write_result
from benchmarks.peers.vllm_engine import capture_sizes, import_vllm

from governor.engine.bench.throughput import Workload
from governor.loadgen.workload import parse_range


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.peers.vllm_throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the checkpoint `governor bench throughput` ran on")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="100:1024", help="a:b, uniform per prompt (as the engine's)")
    p.add_argument("--output-len", default="100:1024", help="a:b, uniform per prompt (as the engine's)")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--quantization", default=None, choices=("fp8",),
                   help="fp8: vLLM quantizes a bf16 checkpoint's weights at load (as the engine's --quantization fp8)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the checkpoint's, as the engine's")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--load-format", default="auto", help="dummy: random weights from config.json, as the engine's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plan", action="store_true", help="print the workload and settings, run nothing")
    return p.parse_args(argv)


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), args.workload_seed)


def engine_prompts(model: str, workload: Workload) -> tuple[list[list[int]], list[int]]:
    """The prompt token ids and output lengths `governor bench throughput` runs on `model`."""
    return workload.make(engine_vocab(model))


def llm_settings(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's `LLM(...)` keyword arguments."""
    settings: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype, "seed": args.seed,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "compilation_config": {"cudagraph_capture_sizes": capture_sizes(args.max_num_seqs)},
        "tensor_parallel_size": args.tensor_parallel_size, "load_format": args.load_format,
    }
    if args.max_model_len is not None:
        settings["max_model_len"] = args.max_model_len
    if args.quantization is not None:
        settings["quantization"] = args.quantization
    return settings


def workload_record(workload: Workload) -> dict[str, Any]:
    """The workload as the engine's throughput envelope records it."""
    return {"num_prompts": workload.num_prompts, "input_len": list(workload.input_len),
            "output_len": list(workload.output_len), "seed": workload.seed, "ignore_eos": True,
            "prompts": "random token ids"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    workload = workload_of(args)
    prompts, out_lens = engine_prompts(args.model, workload)
    settings = llm_settings(args)
    vllm = import_vllm()
    llm = vllm.LLM(**settings)

    def params(n: int) -> Any:
        return vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    llm.generate([{"prompt_token_ids": p[:16]} for p in prompts[:2]], params(4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [params(n) for n in out_lens], use_tqdm=False)
    elapsed = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    result = {
        "backend": "vllm", "vllm": vllm.__version__, "settings": settings,
        "env": {"VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")},
        "elapsed_s": elapsed, "prompt_tokens": prompt_tokens, "generated_tokens": gen,
        "output_tokens_per_s": gen / elapsed, "total_tokens_per_s": (gen + prompt_tokens) / elapsed,
    }
    return write_result("throughput", args.model, result, args.output_json, workload_record(workload))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        prompts, out_lens = engine_prompts(args.model, workload_of(args))
        print(json.dumps({"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                          "output_tokens": sum(out_lens), "first_prompt_head": prompts[0][:8] if prompts else [],
                          "llm": llm_settings(args)}))
        return 0
    env = run(args)
    r = env["result"]
    print(f"vLLM {r['vllm']}: {r['output_tokens_per_s']:.0f} output tok/s ({r['generated_tokens']} tokens in "
          f"{r['elapsed_s']:.2f} s), kv_cache_dtype {args.kv_cache_dtype}, quantization {args.quantization}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
