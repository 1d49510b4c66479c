"""Engine subcommands of `governor` (also `python -m governor.engine ...`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING, Any, get_args

from pydantic import BaseModel

from governor.engine.config import EngineConfig
from governor.engine.server import DEFAULT_MAX_REQUEST_BODY_BYTES, TOOL_CALL_PARSERS
from governor.engine.server.metrics import METRICS_NAMES

if TYPE_CHECKING:  # the benchmarks load torch: imported when a bench command runs
    from governor.engine.bench.throughput import RequestOptions


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig field except `model` as a --kebab-case flag (defaults left to EngineConfig)."""
    for name, field in EngineConfig.model_fields.items():
        if name in ("model",):
            continue
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                           help=field.description)
            continue
        types = set(get_args(field.annotation)) | {field.annotation}
        structured = any(isinstance(t, type) and issubclass(t, BaseModel) for t in types)
        kind: Any = json.loads if structured else float if float in types else int if int in types else str
        p.add_argument(flag, dest=name, type=kind, default=None, help=field.description)


def _engine_args(ns: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(ns, k) for k in EngineConfig.model_fields if k != "model" and getattr(ns, k, None) is not None}


def _add_request_options(p: argparse.ArgumentParser) -> None:
    """What a benchmark's engine requests add to greedy decoding (`bench.throughput.RequestOptions`)."""
    p.add_argument("--penalties", action="store_true",
                   help="presence, frequency and repetition penalties on every request")
    p.add_argument("--structured", default=None, choices=("json",),
                   help="structured outputs on every request: json = a small JSON Schema")


def _request_options(ns: argparse.Namespace) -> RequestOptions:
    from governor.engine.bench.throughput import RequestOptions

    return RequestOptions(penalties=ns.penalties, structured=ns.structured)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="governor")
    sub = parser.add_subparsers(dest="command", required=True)

    # No abbreviations: `--tensor-parallel 2` must not pass for --tensor-parallel-size, so that what the operator
    # refuses in extraArgs (flags it sets itself) is exactly the flag or `flag=value`.
    sv = sub.add_parser("serve", help="serve the engine over an OpenAI-compatible HTTP API", allow_abbrev=False)
    sv.add_argument("model", help="local Hugging Face checkpoint directory")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None, help="model name clients use (default: the dir name)")
    sv.add_argument("--admin-token-file", default=None,
                    help="bearer token for /admin/knobs (else env GOVERNOR_ADMIN_TOKEN; neither: API disabled)")
    sv.add_argument("--max-queue", type=int, default=1024, help="waiting requests beyond this get 429")
    sv.add_argument("--drain-grace-s", type=float, default=30.0,
                    help="on SIGTERM, how long in-flight requests may take to finish")
    sv.add_argument("--revision", default=None, help="revision label on metrics (default env GOVERNOR_REVISION)")
    sv.add_argument("--namespace", default=None,
                    help="namespace label on metrics (default env GOVERNOR_NAMESPACE, else none)")
    sv.add_argument("--salt-per-api-key", action="store_true",
                    help="isolate the prefix cache per client API key (Authorization bearer token)")
    sv.add_argument("--metrics-names", default="governor", choices=METRICS_NAMES,
                    help="governor: Governor's metric names; vllm: vLLM's names (vllm:*) as well, for dashboards, "
                         "autoscaler triggers and gateway endpoint pickers written for vLLM (docs/metrics.md)")
    sv.add_argument("--api-key", default=None,
                    help="require this bearer token on /v1 (else env GOVERNOR_API_KEY; neither: /v1 is open)")
    sv.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                    help="larger request bodies get 413 before they are read (default %(default)s)")
    sv.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                    help="how tool calls are read from chat output (hermes: Qwen/Hermes; llama3_json: Llama 3.x)")
    sv.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="let the model decide to call tools (tool_choice auto); needs --tool-call-parser")
    _add_engine_args(sv)

    mm = sub.add_parser("make-model", help="write a random-weight Hugging Face checkpoint")
    mm.add_argument("dir")
    mm.add_argument("--arch", default="llama", choices=("llama", "qwen2", "qwen3"))
    mm.add_argument("--preset", default="tiny",
                    choices=("tiny", "small", "qwen3-0.6b", "llama3.2-1b", "llama3-8b", "llama3-70b"))
    mm.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--device", default="cpu", help="where weights are generated (cuda is faster for big presets)")
    mm.add_argument("--no-weights", action="store_true",
                    help="write config and tokenizer only, for the engine's --load-format dummy")
    mm.add_argument("--quantization", default=None, choices=("awq", "gptq", "fp8"),
                    help="with --no-weights: name this pre-quantized format in config.json (AWQ and GPTQ int4 in "
                         "groups of 128, fp8 in 128 x 128 blocks); --load-format dummy draws its packed tensors")

    gen = sub.add_parser("generate", help="offline generation with the engine")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    _add_engine_args(gen)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    tp = bsub.add_parser("throughput", help="offline throughput on random prompts (ignore_eos)")
    tp.add_argument("--model", required=True)
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", default="100:1024", help="a:b, uniform per prompt")
    tp.add_argument("--output-len", default="100:1024", help="a:b, uniform per prompt")
    tp.add_argument("--workload-seed", type=int, default=0)
    tp.add_argument("--backend", default="governor", choices=("governor", "hf"),
                    help="hf runs the same workload through transformers generate")
    tp.add_argument("--hf-batch-size", type=int, default=64)
    tp.add_argument("--hf-cache-implementation", default=None, help="hf: generate's cache_implementation, e.g. static")
    tp.add_argument("--hf-attn-implementation", default=None, help="hf: from_pretrained's attn_implementation")
    tp.add_argument("--hf-max-batches", type=int, default=None,
                    help="hf: time only the first N batches and report their rate (marked extrapolated)")
    tp.add_argument("--hf-warmup-tokens", type=int, default=None,
                    help="hf: warm up on a whole first batch, stopped after N new tokens (default: 2 prompts)")
    tp.add_argument("--hf-progress-every", type=int, default=None, help="hf: log time every N generated tokens")
    tp.add_argument("--output-json", default=None)
    _add_request_options(tp)
    _add_engine_args(tp)

    px = bsub.add_parser("prefix", help="TTFT cold vs warm with a shared system prompt; hit-vs-cold divergence")
    px.add_argument("--model", required=True)
    px.add_argument("--system-len", type=int, default=2000)
    px.add_argument("--suffix-len", type=int, default=50)
    px.add_argument("--concurrency", default="1,32", help="comma-separated")
    px.add_argument("--divergence-prompts", type=int, default=32)
    px.add_argument("--divergence-tokens", type=int, default=64)
    px.add_argument("--output-json", default=None)
    _add_engine_args(px)

    kv = bsub.add_parser("kv", help="fp8 vs model-dtype KV: capacity, decode throughput, logit agreement")
    kv.add_argument("--model", required=True)
    kv.add_argument("--context", type=int, default=4096)
    kv.add_argument("--batches", default="32,128", help="comma-separated decode batch sizes")
    kv.add_argument("--new-tokens", type=int, default=64)
    kv.add_argument("--accuracy-prompt-len", type=int, default=64)
    kv.add_argument("--accuracy-tokens", type=int, default=256)
    kv.add_argument("--weights", default=None,
                    help="comma-separated weight formats whose KV capacity to compare, e.g. none,fp8 (none: the "
                         "checkpoint's dense weights; else a --quantization method)")
    kv.add_argument("--output-json", default=None)
    _add_engine_args(kv)

    lt = bsub.add_parser("latency", help="time to first token and per-token decode latency at a context, by batch")
    lt.add_argument("--model", required=True)
    lt.add_argument("--context", type=int, default=512, help="prompt tokens of every request")
    lt.add_argument("--batches", default="1", help="comma-separated batch sizes")
    lt.add_argument("--new-tokens", type=int, default=128)
    lt.add_argument("--output-json", default=None)
    _add_request_options(lt)
    _add_engine_args(lt)

    sp = bsub.add_parser("spec", help="speculative decoding speedup over plain decoding by batch and K")
    sp.add_argument("--model", required=True)
    sp.add_argument("--perturb-sigma", default="0.3", help="comma-separated noise levels for perturbed drafts")
    sp.add_argument("--no-equal-draft", action="store_true", help="skip the draft-equal-to-target variant")
    sp.add_argument("--ngram", action="store_true", help="also sweep the n-gram proposer")
    sp.add_argument("--draft-model", default=None,
                    help="a cheaper draft model sharing the target's vocabulary (e.g. make-model --preset llama3.2-1b)")
    sp.add_argument("--draft-acceptance", default="",
                    help="comma-separated acceptance rates the benchmark sets for --draft-model's proposals (the draft "
                         "and the verification run as usual; each draft is accepted with this probability, in "
                         "order, and the step emits the target's token after the accepted ones); empty: the "
                         "target's own decisions")
    sp.add_argument("--draft-quantization", default=None, choices=["fp8", "awq", "gptq", "compressed-tensors"],
                    help="--draft-model's weight quantization (speculative_config's 'quantization'; 'fp8' quantizes "
                         "an unquantized draft at load)")
    sp.add_argument("--batches", default="1,8,64")
    sp.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    sp.add_argument("--input-len", type=int, default=32)
    sp.add_argument("--output-len", type=int, default=128)
    sp.add_argument("--work-dir", default="/tmp/governor-bench-spec", help="where perturbed drafts are written")
    sp.add_argument("--output-json", default=None)
    _add_engine_args(sp)

    at = bsub.add_parser("attention", help="the paged decode attention kernel alone: KV bandwidth vs HBM copy")
    at.add_argument("--batches", default="32", help="comma-separated")
    at.add_argument("--contexts", default="4096,32768", help="comma-separated tokens per sequence")
    at.add_argument("--heads", default="32:8", help="comma-separated Q:KV head counts")
    at.add_argument("--head-dim", type=int, default=128)
    at.add_argument("--kv-dtypes", default="bf16,fp8", help="comma-separated: bf16, fp16, fp32, fp8")
    at.add_argument("--q-dtype", default="bf16", help="q and output dtype: bf16, fp16, fp32")
    at.add_argument("--block-size", type=int, default=16)
    at.add_argument("--splits", default="auto", help="comma-separated split-KV counts; auto = the kernel's choice")
    at.add_argument("--tables", default="random", help="comma-separated block tables: random, contiguous")
    at.add_argument("--warmup", type=int, default=10)
    at.add_argument("--iters", type=int, default=50)
    at.add_argument("--device", default="auto")
    at.add_argument("--output-json", default=None)

    ar = bsub.add_parser("all-reduce", help="one all-reduce's time by message size: peer-to-peer one-shot and "
                                            "two-shot against NCCL, in CUDA graphs, on this host's GPUs")
    ar.add_argument("--tp", type=int, default=2, help="GPUs (ranks)")
    ar.add_argument("--sizes", default="8K,16K,32K,64K,128K,256K,512K,1M,2M,4M,8M",
                    help="comma-separated message sizes in bytes (K and M suffixes: KiB, MiB)")
    ar.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ar.add_argument("--calls", type=int, default=20, help="all-reduces per captured graph")
    ar.add_argument("--replays", type=int, default=50)
    ar.add_argument("--hidden", type=int, default=4096,
                    help="row width of the all-reduce + residual add + RMSNorm rows (all-reduce, then norm; fused)")
    ar.add_argument("--output-json", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as e:  # pydantic's ValidationError is a ValueError
        print(f"governor {args.command}: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        from governor.engine.server.serve import ServeOptions, read_admin_token, read_api_key, serve

        if args.max_queue < 1:
            raise ValueError(f"--max-queue must be at least 1, got {args.max_queue}")
        if args.max_request_body_bytes < 1024:
            raise ValueError(f"--max-request-body-bytes must be at least 1024, got {args.max_request_body_bytes}")
        if args.enable_auto_tool_choice and args.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        engine_args = _engine_args(args)
        engine_args.setdefault("enable_prefix_caching", True)  # on by default when serving
        config = EngineConfig(model=args.model, **engine_args)
        options = ServeOptions(args.host, args.port, args.served_model_name, read_admin_token(args.admin_token_file),
                               args.max_queue, args.drain_grace_s, args.revision, args.namespace,
                               args.salt_per_api_key, read_api_key(args.api_key), args.max_request_body_bytes,
                               args.tool_call_parser if args.enable_auto_tool_choice else None,
                               metrics_names=args.metrics_names)
        return serve(config, options)
    if args.command == "make-model":
        from governor.engine.models.make_model import make_model

        path = make_model(args.dir, arch=args.arch, preset=args.preset, dtype=args.dtype, seed=args.seed,
                          device=args.device, weights=not args.no_weights, quantization=args.quantization)
        what = "config (no weights)" if args.no_weights else "checkpoint"
        if args.quantization:
            what += f", {args.quantization}"
        print(f"wrote {args.arch}/{args.preset} ({args.dtype}) {what} to {path}")
        return 0
    if args.command == "generate":
        from governor.engine import LLM, SamplingParams

        with LLM(args.model, **_engine_args(args)) as llm:
            outs = llm.generate(args.prompt, SamplingParams(temperature=args.temperature,
                                                            max_tokens=args.max_tokens))
        for o in outs:
            print(json.dumps({"prompt": o.prompt, "text": o.outputs[0].text,
                              "token_ids": o.outputs[0].token_ids, "finish_reason": o.outputs[0].finish_reason}))
        return 0
    if args.command == "bench" and args.bench == "throughput":
        from governor.engine.bench.throughput import HFOptions, Workload, bench_throughput
        from governor.loadgen.workload import parse_range

        workload = Workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len),
                            args.workload_seed)
        hf_flags = (args.hf_cache_implementation, args.hf_attn_implementation, args.hf_max_batches,
                    args.hf_warmup_tokens, args.hf_progress_every)
        hf_options = HFOptions(*hf_flags) if any(f is not None for f in hf_flags) else None
        env = bench_throughput(args.model, workload, args.backend, _engine_args(args), args.hf_batch_size,
                               args.output_json, hf_options, _request_options(args))
        r = env["result"]
        print(f"{r['backend']}: {r['generated_tokens']} output tokens in {r['elapsed_s']:.2f} s = "
              f"{r['output_tokens_per_s']:.1f} output tok/s ({r['total_tokens_per_s']:.1f} total tok/s)")
        if r.get("extrapolated"):
            print(f"  timed {r['batches_timed']} of {r['batches_total']} batches; the whole workload at this rate: "
                  f"{r['elapsed_s_extrapolated_to_workload']:.1f} s (extrapolated, not run)")
        if args.output_json:
            print(f"envelope written to {args.output_json}")
        return 0
    if args.command == "bench" and args.bench == "latency":
        from governor.engine.bench import cache as bench_cache
        from governor.engine.bench.latency import bench_latency

        result = bench_latency(args.model, _engine_args(args), args.context,
                               [int(b) for b in args.batches.split(",")], args.new_tokens,
                               options=_request_options(args))
        eng = result["engine"]
        print("CUDA graphs: " + (f"{eng['cuda_graph_captures']} captured in {eng['cuda_graph_capture_s']:.1f} s"
                                 if eng["cuda_graphs"] else "off (eager)"))
        for row in result["rows"]:
            print(f"batch {row['batch']} at {row['context']} tokens: TTFT {row['ttft_ms']:.1f} ms, decode "
                  f"{row['ms_per_token_p50']:.2f} ms/token (p50; mean {row['ms_per_token_mean']:.2f}), "
                  f"{row['decode_tok_s']:.0f} tok/s")
            if "roofline_ms" in row:
                print(f"  GPU time of the step {row['forward_ms_p50']:.2f} ms; memory roofline "
                      f"{row['roofline_ms']:.2f} ms ({eng['hbm_copy_gb_per_s']:.0f} GB/s copy): "
                      f"{100 * row['roofline_fraction_p50']:.0f}% of it")
        bench_cache.write_envelope("bench-latency", args.model, result, args.output_json)
        return 0
    if args.command == "bench" and args.bench == "spec":
        from governor.engine.bench import cache as bench_cache
        from governor.engine.bench import spec as bench_spec

        variants: dict[str, dict[str, Any]] = {}
        if not args.no_equal_draft:
            variants["draft=target"] = {"method": "draft_model", "model": args.model}
        for sigma in (float(x) for x in args.perturb_sigma.split(",") if x):
            draft = bench_spec.perturbed_copy(args.model, f"{args.work_dir}/sigma-{sigma}", sigma)
            variants[f"draft=target+noise({sigma})"] = {"method": "draft_model", "model": draft}
        if args.ngram:
            variants["ngram"] = {"method": "ngram"}
        if args.draft_model:
            name = args.draft_model.rstrip("/").rsplit("/", 1)[-1]
            draft_spec: dict[str, Any] = {"method": "draft_model", "model": args.draft_model}
            if args.draft_quantization:
                name += f" ({args.draft_quantization})"
                draft_spec["quantization"] = args.draft_quantization
            rates = [float(x) for x in args.draft_acceptance.split(",") if x]
            for alpha in rates:
                variants[f"draft={name} alpha={alpha}"] = {**draft_spec, "controlled_acceptance": alpha}
            if not rates:
                variants[f"draft={name}"] = draft_spec
        elif args.draft_acceptance or args.draft_quantization:
            raise SystemExit("--draft-acceptance and --draft-quantization need --draft-model")
        result = bench_spec.bench_spec(args.model, _engine_args(args), variants,
                                       [int(b) for b in args.batches.split(",")], [int(k) for k in args.ks.split(",")],
                                       args.input_len, args.output_len)
        print(json.dumps(result["crossover"]))
        bench_cache.write_envelope("bench-spec", args.model, result, args.output_json)
        return 0
    if args.command == "bench" and args.bench in ("prefix", "kv"):
        from governor.engine.bench import cache as bench_cache

        if args.bench == "prefix":
            result = bench_cache.bench_prefix(args.model, _engine_args(args), args.system_len, args.suffix_len,
                                              [int(c) for c in args.concurrency.split(",")],
                                              args.divergence_prompts, args.divergence_tokens)
            for row in result["ttft"]:
                print(f"concurrency {row['concurrency']}: TTFT cold {row['cold']['mean_ms']:.1f} ms, warm "
                      f"{row['warm']['mean_ms']:.1f} ms (mean), {row['speedup_mean']:.1f}x")
            d = result["divergence"]
            print(f"hit vs cold: {d['identical']}/{d['prompts']} identical over {d['tokens']} greedy tokens")
        else:
            result = bench_cache.bench_kv(args.model, _engine_args(args), args.context,
                                          [int(b) for b in args.batches.split(",")], args.new_tokens,
                                          args.accuracy_prompt_len, args.accuracy_tokens,
                                          weights=args.weights.split(",") if args.weights else None)
            for name, w in result.get("weights", {}).items():
                print(f"weights {name}: {w['weight_bytes'] / 2**20:.1f} MiB of weights, {w['kv_blocks_total']} KV "
                      f"blocks, {w['max_concurrent_at_context']} sequences of {args.context} tokens")
            for name, row in result["variants"].items():
                print(f"{name} ({row['kv_dtype']}): {row['kv_blocks_total']} blocks, "
                      f"{row['max_concurrent_at_context']} sequences of {args.context} tokens; decode " +
                      ", ".join(f"batch {d['batch']}: {d['decode_tok_s']:.0f} tok/s" for d in row["decode"]))
            a = result["accuracy"]
            print(f"fp8 vs model dtype over {a['positions']} positions: top-1 {a['top1_agreement']:.4f}, "
                  f"mean KL {a['mean_kl']:.3g}")
        bench_cache.write_envelope(f"bench-{args.bench}", args.model, result, args.output_json)
        return 0
    if args.command == "bench" and args.bench == "all-reduce":
        import torch

        from governor.engine.bench import cache as bench_cache
        from governor.engine.bench.all_reduce import bench_all_reduce, parse_sizes

        dtype = getattr(torch, args.dtype)
        result = bench_all_reduce(args.tp, parse_sizes(args.sizes), dtype, args.calls, args.replays, args.hidden)
        for row in result["rows"]:
            print(f"{row['bytes']:>9} B {row['path']:>13}: {row['us']:7.1f} us (max error {row['max_abs_err']:.3g})")
        bench_cache.write_envelope("bench-all-reduce", "-", result, args.output_json)
        return 0
    if args.command == "bench" and args.bench == "attention":
        from governor.engine.bench import attention as ba

        cases = ba.parse_cases(args.batches, args.contexts, args.heads, args.head_dim, args.kv_dtypes,
                               args.block_size, args.splits, args.tables)
        if args.q_dtype not in ba.KV_DTYPES or args.q_dtype == "fp8":
            raise ValueError(f"--q-dtype must be bf16, fp16 or fp32, got {args.q_dtype!r}")

        def show(partial: dict[str, Any]) -> None:
            r = partial["rows"][-1]
            frac = f", {100 * r['fraction_of_hbm']:.0f}% of HBM copy" if "fraction_of_hbm" in r else ""
            kernels = ""
            if "kernel_us_p50" in r:
                kernels = f"; kernels alone {r['kernel_us_p50']:.1f} us"
                if "fraction_of_hbm_kernels" in r:
                    kernels += f", {100 * r['fraction_of_hbm_kernels']:.0f}%"
            print(f"batch {r['batch']} ctx {r['context']} {r['num_q_heads']}:{r['num_kv_heads']}x{r['head_dim']} "
                  f"{r['kv_dtype']} block {r['block_size']} {r['table']} splits {r['num_splits'] or 'auto'}"
                  f"={r['num_splits_run']}: {r['us_p50']:.1f} us p50, {r['kv_gb_per_s']:.0f} GB/s{frac}{kernels}",
                  flush=True)
            ba.write_envelope(partial, args.output_json)

        result = ba.bench_attention(cases, ba.KV_DTYPES[args.q_dtype], args.device, args.warmup, args.iters, show)
        if result["info"]["hbm_copy_gb_per_s"]:
            print(f"HBM copy: {result['info']['hbm_copy_gb_per_s']:.0f} GB/s")
        ba.write_envelope(result, args.output_json)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
