"""`governor bench throughput`: offline throughput on random prompts with ignore_eos (like nano-vllm's bench).

The same workload runs through the engine or, with backend "hf", through Hugging Face transformers
`generate` on the same device, so both figures come from one command and one envelope.
"""

from __future__ import annotations

import json
import platform
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Workload:
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0

    def make(self, vocab_size: int) -> tuple[list[list[int]], list[int]]:
        """Random prompt token ids and output lengths, the same for a given seed and vocabulary."""
        rng = random.Random(self.seed)
        prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*self.input_len))]
                   for _ in range(self.num_prompts)]
        outputs = [rng.randint(*self.output_len) for _ in range(self.num_prompts)]
        return prompts, outputs


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "platform": platform.platform(),
                            "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = None
    return info


def run_engine(model: str, workload: Workload, engine_args: dict[str, Any]) -> dict[str, Any]:
    from governor.engine import LLM, SamplingParams

    with LLM(model, **engine_args) as llm:
        eng = llm.engine
        prompts, out_lens = workload.make(min(eng.model_config.vocab_size, len(eng.tokenizer)))
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
        # Warm-up (kernel compilation, allocator) on a small slice, not timed.
        llm.generate([p[:16] for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        sync_device()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        sync_device()
        elapsed = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.stats()
    return {
        "backend": "governor",
        "model_digest": eng.model_digest,
        "tokenizer_digest": eng.tokenizer_digest,
        "model_config": {k: v for k, v in vars(eng.model_config).items() if k != "rope"},
        "device": str(eng.device),
        "dtype": str(eng.dtype).removeprefix("torch."),
        "engine_settings_non_default": eng.config.non_default_settings(),
        "kv_blocks_total": stats["kv_blocks_total"],
        "preemptions": stats["preemptions"],
        "steps": stats["steps"],
        "elapsed_s": elapsed,
        "prompt_tokens": sum(len(p) for p in prompts),
        "generated_tokens": gen,
        "output_tokens_per_s": gen / elapsed,
        "total_tokens_per_s": (gen + sum(len(p) for p in prompts)) / elapsed,
    }


def run_hf(model: str, workload: Workload, dtype: str, device: str, batch_size: int) -> dict[str, Any]:
    """The same workload through transformers `generate` (left-padded static batches, ignore_eos via
    min_new_tokens). Batches are formed after sorting by output length so padding waste is small;
    throughput counts only the requested output tokens."""
    from transformers import AutoModelForCausalLM

    from governor.engine.models.checkpoint import model_digest
    from governor.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    hf = hf.to(device).eval()
    vocab = min(hf.config.vocab_size, len(tok))
    prompts, out_lens = workload.make(vocab)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    order = sorted(range(len(prompts)), key=lambda i: out_lens[i])

    def run_batch(idx: list[int]) -> None:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        n = max(out_lens[i] for i in idx)
        with torch.inference_mode():
            hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=pad)

    run_batch(order[:2])  # warm-up
    sync_device()
    t0 = time.perf_counter()
    for b in range(0, len(order), batch_size):
        run_batch(order[b:b + batch_size])
    sync_device()
    elapsed = time.perf_counter() - t0
    gen = sum(out_lens)
    return {
        "backend": "hf-transformers-generate",
        "transformers": __import__("transformers").__version__,
        "model_digest": model_digest(model),
        "device": device,
        "dtype": dtype,
        "batch_size": batch_size,
        "elapsed_s": elapsed,
        "prompt_tokens": sum(len(p) for p in prompts),
        "generated_tokens": gen,
        "output_tokens_per_s": gen / elapsed,
        "total_tokens_per_s": (gen + sum(len(p) for p in prompts)) / elapsed,
    }


def sync_device() -> None:
    """Wait for queued GPU work, so wall-clock timings cover it (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_throughput(model: str, workload: Workload, backend: str, engine_args: dict[str, Any],
                     hf_batch_size: int, output_json: str | None) -> dict[str, Any]:
    if backend == "governor":
        result = run_engine(model, workload, engine_args)
    elif backend == "hf":
        device = engine_args.get("device", "auto")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        dtype = engine_args.get("dtype", "auto")
        if dtype == "auto":
            dtype = "bfloat16" if device == "cuda" else "float32"
        result = run_hf(model, workload, dtype, device, hf_batch_size)
    else:
        raise ValueError(f"backend must be 'governor' or 'hf', got {backend!r}")
    envelope = {
        "benchmark": "throughput",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "hardware": hardware(),
        "workload": {"num_prompts": workload.num_prompts, "input_len": list(workload.input_len),
                     "output_len": list(workload.output_len), "seed": workload.seed, "ignore_eos": True,
                     "prompts": "random token ids"},
        "model": str(Path(model).resolve()),
        "result": result,
    }
    if output_json:
        Path(output_json).write_text(json.dumps(envelope, indent=2, default=str) + "\n")
    return envelope
