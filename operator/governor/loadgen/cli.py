"""`governor bench serve`: load an OpenAI-compatible server and report latency, throughput and goodput.

Prints a table and then the results as one JSON line (the last line of stdout, for scripts);
`--output-json` writes the full envelope. Exit status: 0 when at least one request completed,
1 when none did (server down, wrong model, ...), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from governor.loadgen.benchmark import BenchConfig, run_benchmark
from governor.loadgen.report import SLO, format_table, make_envelope
from governor.loadgen.workload import parse_range


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the `bench serve` flags to `p`."""
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", required=True, help="the model name the server expects in requests")
    p.add_argument("--endpoint", default="completions", choices=("completions", "chat"),
                   help="/v1/completions or /v1/chat/completions (default: completions)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s with Poisson arrivals; inf sends all at once (default: inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests to send at most (default: 1000)")
    p.add_argument("--duration", type=float, default=None,
                   help="stop sending after this many seconds; in-flight requests finish (default: no limit)")
    p.add_argument("--input-len", default="1024",
                   help="prompt words per request, 'a:b' uniform or 'n' (≈ tokens; the server's count is reported)")
    p.add_argument("--output-len", default="128", help="max_tokens per request, 'a:b' uniform or 'n' (default: 128)")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="words of one prefix shared by every prompt, before its --input-len words (prefix caching)")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals (default: 0)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput counts requests with TTFT at most this")
    p.add_argument("--slo-itl-ms", type=float, default=None,
                   help="goodput counts requests whose mean inter-token latency is at most this")
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput counts requests with E2E at most this")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (never written to the JSON)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request, send to [DONE] (default: 300)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate exactly max_tokens (vLLM's ignore_eos; default: on)")
    p.add_argument("--return-token-ids", action="store_true",
                   help="send vLLM's return_token_ids and time TTFT/ITL at chunks carrying token ids, so tokens "
                        "with no text of their own (partial UTF-8, ids outside the tokenizer) are timed too; the "
                        "server must support it (Governor and recent vLLM do; default: off, chunks carrying text)")
    p.add_argument("--output-json", default=None, help="write the JSON envelope (args, client, server, results) here")
    p.add_argument("--save-requests", action="store_true",
                   help="include per-request records under \"requests\" in --output-json")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig the parsed flags describe (ValueError with every problem when they are invalid)."""
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, num_prompts=args.num_prompts, duration_s=args.duration,
        input_len=parse_range(args.input_len), output_len=parse_range(args.output_len),
        shared_prefix_len=args.shared_prefix_len, seed=args.seed,
        slo=SLO(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms, e2e_ms=args.slo_e2e_ms),
        api_key=args.api_key, timeout_s=args.timeout, ignore_eos=args.ignore_eos,
        return_token_ids=args.return_token_ids)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the parsed flags describe; print the table and the results JSON line."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"governor bench serve: error: {e}", file=sys.stderr)
        return 2
    rate = "all at once" if math.isinf(config.request_rate) else f"{config.request_rate:g} req/s"
    print(f"sending up to {config.num_prompts} requests to {config.url} ({rate}, max concurrency "
          f"{config.max_concurrency or 'unlimited'})", file=sys.stderr)
    result = asyncio.run(run_benchmark(config))
    print(format_table(result))
    if config.return_token_ids and result.completed and result.timing != "token_ids":
        print("governor bench serve: warning: the server sent no token_ids (it ignores return_token_ids); "
              "TTFT and ITL time chunks carrying text", file=sys.stderr)
    print(json.dumps(result.to_dict()))
    if args.output_json:
        recorded = dict(vars(args), api_key="<redacted>" if args.api_key else None)
        envelope = make_envelope(recorded, config.base_url, config.url, config.model, result, args.save_requests)
        Path(args.output_json).write_text(json.dumps(envelope, indent=2) + "\n")
        print(f"envelope written to {args.output_json}", file=sys.stderr)
    if not result.completed:
        print(f"governor bench serve: no request completed; failures: {result.failures}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`governor bench serve ...` (argv without the 'bench serve' words)."""
    parser = argparse.ArgumentParser(
        prog="governor bench serve",
        description="Load an OpenAI-compatible server and report latency, throughput and goodput.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
