"""`governor bench throughput`: offline throughput on random prompts with ignore_eos (like nano-vllm's bench).

The same workload runs through the engine or, with backend "hf", through Hugging Face transformers
`generate` on the same device, so both figures come from one command and one envelope.

Engine requests are greedy; `--penalties` gives every one presence, frequency and repetition penalties, and
`--structured json` constrains every one to a small JSON Schema (it then ends when its object is complete),
so the cost of logits processing shows against the plain run (`RequestOptions`, shared with `bench latency`).
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

from governor.engine.sampling_params import SamplingParams, StructuredOutputsParams

# `--structured json`: a small schema with bounded fields, so a random model's object ends in tens of tokens.
BENCH_JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "active"],
    "additionalProperties": False,
}
STRUCTURED_KINDS = ("json",)


@dataclass(frozen=True)
class RequestOptions:
    """What a benchmark's engine requests use beyond greedy decoding: penalties (presence 0.5, frequency 0.5,
    repetition 1.1 on every request) and/or structured outputs ("json": BENCH_JSON_SCHEMA on every request)."""

    penalties: bool = False
    structured: str | None = None

    def __post_init__(self) -> None:
        if self.structured is not None and self.structured not in STRUCTURED_KINDS:
            raise ValueError(f"structured must be one of {', '.join(STRUCTURED_KINDS)}, got {self.structured!r}")

    def params(self, max_tokens: int) -> SamplingParams:
        """The sampling parameters of one benchmark request generating up to `max_tokens` tokens (ignore_eos)."""
        on = self.penalties
        schema = StructuredOutputsParams(json=BENCH_JSON_SCHEMA) if self.structured == "json" else None
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                              presence_penalty=0.5 if on else 0.0, frequency_penalty=0.5 if on else 0.0,
                              repetition_penalty=1.1 if on else 1.0, structured_outputs=schema)

    def describe(self) -> dict[str, Any]:
        """The options as a benchmark result records them."""
        return {"penalties": self.penalties, "structured": self.structured}


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


def run_engine(model: str, workload: Workload, engine_args: dict[str, Any],
               options: RequestOptions | None = None) -> dict[str, Any]:
    from governor.engine import LLM
    from governor.engine.gc_freeze import startup_objects_frozen

    opts = options or RequestOptions()
    with LLM(model, **engine_args) as llm:
        eng = llm.engine
        prompts, out_lens = workload.make(min(eng.model_config.vocab_size, len(eng.tokenizer)))
        params = [opts.params(n) for n in out_lens]
        # Warm-up (kernel compilation, allocator, a structured request's grammar) on a small slice, not timed.
        llm.generate([p[:16] for p in prompts[:2]], opts.params(4))
        with startup_objects_frozen():  # as `governor serve` has them once its engine has started
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
        "requests": opts.describe(),
    }


@dataclass
class HFOptions:
    """Optional transformers settings of the hf backend (all None/defaults: the plain `generate` run).

    cache_implementation: passed to `generate` ("static" preallocates the KV cache; transformers then
      compiles the decode forward with torch.compile, mode "reduce-overhead", on CUDA by itself).
    attn_implementation: passed to `from_pretrained` ("sdpa", "eager", ...; None: transformers' default).
    max_batches: time only the first N batches of batch_size and report their rate (extrapolated, flagged
      in the result); None times them all.
    warmup_tokens: None keeps the small warm-up (2 prompts); N warms up on a whole first batch with the
      timed run's max_new_tokens, stopped after N new tokens, so a static cache and compiled graphs of the
      timed shape exist before timing.
    progress_every: log the elapsed time every N generated tokens of each timed batch (syncs the GPU then).
    """

    cache_implementation: str | None = None
    attn_implementation: str | None = None
    max_batches: int | None = None
    warmup_tokens: int | None = None
    progress_every: int | None = None


def _stop_after(tokens: int, every: int | None, label: str) -> Any:
    """A StoppingCriteria that ends generation after `tokens` new tokens (0: never) and, every `every`
    tokens, prints the seconds since the first call."""
    from transformers import StoppingCriteria

    class StopAfter(StoppingCriteria):
        def __init__(self) -> None:
            self.start_len: int | None = None
            self.t0 = time.perf_counter()

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            if self.start_len is None:
                self.start_len = input_ids.shape[1] - 1
            new = input_ids.shape[1] - self.start_len
            if every and new % every == 0:
                sync_device()
                print(f"{label}: {new} tokens at {time.perf_counter() - self.t0:.2f} s", flush=True)
            return torch.full((input_ids.shape[0],), bool(tokens) and new >= tokens, dtype=torch.bool,
                              device=input_ids.device)

    return StopAfter()


def run_hf(model: str, workload: Workload, dtype: str, device: str, batch_size: int,
           options: HFOptions | None = None) -> dict[str, Any]:
    """The same workload through transformers `generate` (left-padded static batches, ignore_eos via
    min_new_tokens). Batches are formed after sorting by output length so padding waste is small;
    throughput counts only the requested output tokens."""
    from transformers import AutoModelForCausalLM, StoppingCriteriaList

    from governor.engine.models.checkpoint import model_digest
    from governor.engine.tokenizer import load_tokenizer

    opts = options or HFOptions()
    tok = load_tokenizer(model)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    load_kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if opts.attn_implementation is not None:
        load_kwargs["attn_implementation"] = opts.attn_implementation
    hf: Any = AutoModelForCausalLM.from_pretrained(model, **load_kwargs)
    hf = hf.to(device).eval()
    vocab = min(hf.config.vocab_size, len(tok))
    prompts, out_lens = workload.make(vocab)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    order = sorted(range(len(prompts)), key=lambda i: out_lens[i])
    gen_kwargs: dict[str, Any] = {}
    if opts.cache_implementation is not None:
        gen_kwargs["cache_implementation"] = opts.cache_implementation

    def run_batch(idx: list[int], stop: Any = None) -> None:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        n = max(out_lens[i] for i in idx)
        extra = dict(gen_kwargs)
        if stop is not None:
            extra["stopping_criteria"] = StoppingCriteriaList([stop])
        with torch.inference_mode():
            hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=pad, **extra)

    batches = [order[b:b + batch_size] for b in range(0, len(order), batch_size)]
    timed = batches if opts.max_batches is None else batches[:opts.max_batches]
    t_warm = time.perf_counter()
    if opts.warmup_tokens is None:
        run_batch(order[:2])  # warm-up
    else:
        run_batch(batches[0], _stop_after(opts.warmup_tokens, None, "warm-up"))
    sync_device()
    warmup_s = time.perf_counter() - t_warm
    graphs_before = _dynamo_unique_graphs()
    batch_s = []
    for k, idx in enumerate(timed):
        t_b = time.perf_counter()
        run_batch(idx, _stop_after(0, opts.progress_every, f"batch {k}") if opts.progress_every else None)
        sync_device()
        batch_s.append(time.perf_counter() - t_b)
    elapsed = sum(batch_s)
    gen = sum(out_lens[i] for idx in timed for i in idx)
    prompt_tokens = sum(len(prompts[i]) for idx in timed for i in idx)
    result: dict[str, Any] = {
        "backend": "hf-transformers-generate",
        "transformers": __import__("transformers").__version__,
        "model_digest": model_digest(model),
        "device": device,
        "dtype": dtype,
        "batch_size": batch_size,
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": gen,
        "output_tokens_per_s": gen / elapsed,
        "total_tokens_per_s": (gen + prompt_tokens) / elapsed,
    }
    if options is not None:  # the plain run's result keeps its original keys
        result.update({
            "options": vars(opts),
            "attn_implementation": getattr(hf.config, "_attn_implementation", None),
            "warmup_s": warmup_s,
            "batch_s": batch_s,
            "batches_timed": len(timed),
            "batches_total": len(batches),
            "extrapolated": len(timed) < len(batches),
            "workload_generated_tokens": sum(out_lens),
            "elapsed_s_extrapolated_to_workload": elapsed * sum(out_lens) / gen,
            "dynamo_graphs_compiled_during_timing": _dynamo_unique_graphs() - graphs_before,
        })
    return result


def _dynamo_unique_graphs() -> int:
    """Graphs torch.compile has compiled so far in this process (0 if dynamo was never used)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def sync_device() -> None:
    """Wait for queued GPU work, so wall-clock timings cover it (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_until_every_request_decodes(engine: Any) -> None:
    """Step an `LLMEngine` until no request waits and every running one has its first token: the steps after this
    are decode steps (what the profiling scripts time), however many prefill chunks a large batch needs first."""
    sched = engine.scheduler
    while sched.waiting or any(not s.output_token_ids for s in sched.running):
        engine.step()


def bench_throughput(model: str, workload: Workload, backend: str, engine_args: dict[str, Any],
                     hf_batch_size: int, output_json: str | None, hf_options: HFOptions | None = None,
                     options: RequestOptions | None = None) -> dict[str, Any]:
    if backend == "governor":
        result = run_engine(model, workload, engine_args, options)
    elif backend == "hf":
        if options is not None and options != RequestOptions():
            raise ValueError("--penalties and --structured apply to the governor backend only")
        device = engine_args.get("device", "auto")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        dtype = engine_args.get("dtype", "auto")
        if dtype == "auto":
            dtype = "bfloat16" if device == "cuda" else "float32"
        result = run_hf(model, workload, dtype, device, hf_batch_size, hf_options)
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
