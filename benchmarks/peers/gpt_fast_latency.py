"""gpt-fast's batch-1 decode latency on a model shape of its own with random weights, bf16, or int8 or int4
weight-only:

    python3 -m benchmarks.peers.gpt_fast_latency --gpt-fast-dir .peers/gpt-fast --weights bf16|int8|int4 \\
        --context 512 --new-tokens 128 --output-json lat-gpt-fast-bf16.json

The model is gpt-fast's `Transformer.from_name(--model-name)` (default llama-3-8b, the shape of the engine's
llama3-8b preset) with random bf16 weights drawn on the GPU; int8 quantizes them with gpt-fast's
`WeightOnlyInt8QuantHandler` (per-channel int8 weights, bf16 scales), as its quantize.py does; int4 with its
`WeightOnlyInt4QuantHandler` (groups of 128, inner_k_tiles 8, for `torch.ops.aten._weight_int4pack_mm`). gpt-fast
hands `_convert_weight_to_int4pack` one int32 per code, which PyTorch since 2.5 refuses: it takes two 4-bit codes per
uint8, so the codes are packed that way first (what torchao does); nothing else of gpt-fast changes. Both handlers
quantize every linear, the output projection (lm_head) included. It is compiled as
gpt-fast's generate.py compiles it (its module's inductor settings, `torch.compile(decode_one_token,
mode="reduce-overhead", fullgraph=True)`, everything under `torch.no_grad()`) and run by gpt-fast's own
`prefill` and `decode_n_tokens` with its default sampling (temperature 0.8, top-k 200).

Measured as `governor bench latency` measures the engine (`decode_timing`): after an untimed generation of the
same length (compilation, CUDA-graph recording), a `--context`-token random prompt is prefilled (ending TTFT),
then each decoded token is copied to the host as it comes (gpt-fast's per-token callback), so the host time
between two tokens is one decode step's time; the row reports p50, mean and p90 of ms per token. gpt-fast's own
figure, which lets the host run ahead of the GPU, is recorded beside it as `ms_per_token_unsynced` (the same
decode without the per-token copy, total time over tokens). `--plan` imports gpt-fast and prints the shape
without touching a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
import types
from pathlib import Path
from typing import Any

from benchmarks.peers.decode_timing import check_new_tokens, decode_steps, latency_row
from benchmarks.peers.peer import PeerMissing, import_peer, write_result

from governor.engine.bench.cache import random_ids

HINT = ("gpt-fast is not importable from --gpt-fast-dir: point it at a gpt-fast checkout (`python3 -m "
        "benchmarks.peers.bundle build` puts one at .peers/gpt-fast)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.peers.gpt_fast_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpt-fast-dir", type=Path, required=True, help="a gpt-fast checkout (model.py, generate.py)")
    p.add_argument("--weights", default="bf16", choices=("bf16", "int8", "int4"),
                   help="int8: weight-only, per channel; int4: weight-only, groups of 128")
    p.add_argument("--model-name", default="llama-3-8b", help="a name of gpt-fast's transformer_configs")
    p.add_argument("--context", type=int, default=512, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated, the first included")
    p.add_argument("--temperature", type=float, default=0.8, help="gpt-fast generate.py's default")
    p.add_argument("--top-k", type=int, default=200, help="gpt-fast generate.py's default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plan", action="store_true", help="import gpt-fast, print the shape, run nothing")
    args = p.parse_args(argv)
    check_new_tokens(p, args.new_tokens)
    return args


def import_gpt_fast(gpt_fast_dir: Path) -> tuple[Any, Any]:
    """gpt-fast's generate and quantize modules from a checkout. Both import gpt-fast's tokenizer module, which
    needs sentencepiece and tiktoken; random prompts never tokenize, so without those packages a stand-in module
    takes its place, whose get_tokenizer says so."""
    if not (gpt_fast_dir / "generate.py").is_file():
        raise PeerMissing(f"{HINT}; {gpt_fast_dir} has no generate.py")
    sys.path.insert(0, str(gpt_fast_dir.resolve()))
    if any(importlib.util.find_spec(m) is None for m in ("sentencepiece", "tiktoken")):
        stand_in = types.ModuleType("tokenizer")

        def get_tokenizer(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("gpt-fast's tokenizer needs sentencepiece and tiktoken, which are not installed")

        stand_in.get_tokenizer = get_tokenizer  # type: ignore[attr-defined]
        sys.modules["tokenizer"] = stand_in
    return import_peer("generate", HINT), import_peer("quantize", HINT)


def random_model(generate: Any, quantize: Any, name: str, weights: str) -> Any:
    """gpt-fast's Transformer of shape `name` on the GPU with random bf16 weights (norms 1), int8 or int4 weight-only
    quantized by gpt-fast's handler when `weights` says so."""
    import torch

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = generate.Transformer.from_name(name)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    if weights in ("int8", "int4"):
        if weights == "int4":
            quantize.prepare_int4_weight_and_scales_and_zeros = _int4_packing(quantize)
            handler = quantize.WeightOnlyInt4QuantHandler(model, groupsize=128, inner_k_tiles=8)
        else:
            handler = quantize.WeightOnlyInt8QuantHandler(model)
        state = handler.create_quantized_state_dict()
        model = handler.convert_for_runtime()
        model.load_state_dict(state, assign=True)
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


def _int4_packing(quantize: Any) -> Any:
    """gpt-fast's prepare_int4_weight_and_scales_and_zeros with its codes packed two per uint8 (high nibble first)
    before `_convert_weight_to_int4pack`, as PyTorch since 2.5 takes them."""
    import torch

    def prepare(weight_bf16: Any, groupsize: int, inner_k_tiles: int) -> tuple[Any, Any]:
        codes, scales_and_zeros = quantize.group_quantize_tensor(weight_bf16, n_bit=4, groupsize=groupsize)
        packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles), scales_and_zeros

    return prepare


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    generate, quantize = import_gpt_fast(args.gpt_fast_dir)
    if not torch.cuda.is_available():
        raise PeerMissing("gpt-fast's latency run needs a CUDA GPU (CUDA graphs through torch.compile)")
    torch.manual_seed(args.seed)
    model = random_model(generate, quantize, args.model_name, args.weights)
    vocab = model.config.vocab_size
    sampling = {"temperature": args.temperature, "top_k": args.top_k}
    with torch.device("cuda"):
        model.setup_caches(max_batch_size=1, max_seq_length=args.context + args.new_tokens)
    # As gpt-fast's generate.py main() does: the module's own decode_one_token, rebound to its compiled form.
    generate.decode_one_token = torch.compile(generate.decode_one_token, mode="reduce-overhead", fullgraph=True)

    def once(prompt: torch.Tensor, per_token_sync: bool) -> tuple[float, list[tuple[float, int]], float]:
        """(TTFT, arrivals of each token on the host, seconds of the whole decode) of one generation."""
        arrivals: list[tuple[float, int]] = []

        def on_token(token: torch.Tensor) -> None:
            if per_token_sync:
                token.tolist()
                arrivals.append((time.perf_counter(), 1))

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        input_pos = torch.arange(0, args.context, device="cuda")
        first = generate.prefill(model, prompt.view(1, -1), input_pos, **sampling).clone()
        first.tolist()
        t_first = time.perf_counter()
        arrivals.append((t_first, 1))
        input_pos = torch.tensor([args.context], device="cuda", dtype=torch.int)
        generate.decode_n_tokens(model, first.view(1, -1), input_pos, args.new_tokens - 1, callback=on_token,
                                 **sampling)
        torch.cuda.synchronize()
        return t_first - t0, arrivals, time.perf_counter() - t_first

    rng = random.Random(args.seed)
    prompt = torch.tensor(random_ids(rng, vocab, args.context), device="cuda", dtype=torch.int)
    with torch.no_grad():
        t_compile = time.perf_counter()
        once(prompt, per_token_sync=True)  # compiles and records the CUDA graphs
        warm_s = time.perf_counter() - t_compile
        ttft, arrivals, _ = once(prompt, per_token_sync=True)
        _, _, unsynced_s = once(prompt, per_token_sync=False)
    row = latency_row(1, args.context, args.new_tokens, ttft, decode_steps(arrivals))
    row["ms_per_token_unsynced"] = 1e3 * unsynced_s / (args.new_tokens - 1)
    info = {"peer": "gpt-fast", "model_name": args.model_name, "weights": args.weights, "sampling": sampling,
            "compile": "torch.compile(decode_one_token, mode='reduce-overhead', fullgraph=True)",
            "first_generation_s": warm_s, "torch": torch.__version__}
    return write_result("bench-latency", f"{args.gpt_fast_dir}/{args.model_name}", {"rows": [row], "engine": info},
                        args.output_json)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        import_gpt_fast(args.gpt_fast_dir)
        shape = vars(import_peer("model", HINT).ModelArgs.from_name(args.model_name))
        print(json.dumps({"model_name": args.model_name, "weights": args.weights, "shape": shape,
                          "context": args.context, "new_tokens": args.new_tokens}, default=str))
        return 0
    row = run(args)["result"]["rows"][0]
    print(f"gpt-fast {args.weights} batch 1 at {row['context']} context: {row['ms_per_token_p50']:.2f} ms/token p50 "
          f"(mean {row['ms_per_token_mean']:.2f}, unsynced {row['ms_per_token_unsynced']:.2f}), "
          f"TTFT {row['ttft_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
