"""The `governor` command: one entry point, each subcommand imported only when used.

This module is torch-free so the operator image (no torch) can run `governor operator`.
Engine subcommands are dispatched to `governor.engine.cli`, which imports torch lazily;
`bench serve` (a load generator for OpenAI-compatible servers) goes to the torch-free `governor.loadgen.cli`,
`tune` (the SLO controller) to the torch-free `governor.tuner.cli`, `crds` to the torch-free
`governor.operator.crds`.
"""

from __future__ import annotations

import sys

ENGINE_COMMANDS = ("serve", "make-model", "bench", "generate")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: governor {" + ",".join(ENGINE_COMMANDS) + "} ...\n")
        print("  serve        the engine as an OpenAI-compatible HTTP server: `governor serve MODEL_DIR ...`")
        print("  make-model   write a random-weight Hugging Face checkpoint (tests, demos, benchmarks)")
        print("  bench        benchmarks: `governor bench throughput --model DIR ...`")
        print("  bench serve  load an OpenAI-compatible server: `governor bench serve --base-url URL --model NAME ...`")
        print("  generate     offline generation with the engine")
        print("  tune         the SLO controller: `governor tune simulate --scenario NAME --out DIR`, `tune run`")
        print("  demo         the whole loop on this machine: `governor demo --duration S --out DIR`")
        print("  operator     the kopf operator for InferenceService: `governor operator [-A | -n NS]`")
        print("  crds         regenerate the InferenceService CRD: `governor crds [--out-dir DIR ...]`")
        return 0 if args else 2
    if args[:2] == ["bench", "serve"]:  # checked before the engine's `bench`: the load generator needs no torch
        from governor.loadgen.cli import main as bench_serve_main

        return bench_serve_main(args[2:])
    if args[0] == "operator":
        from governor.operator.main import main as operator_main

        return operator_main(args[1:])
    if args[0] == "demo":
        from governor.demo import main as demo_main

        return demo_main(args[1:])
    if args[0] == "tune":
        from governor.tuner.cli import main as tune_main

        return tune_main(args[1:])
    if args[0] == "crds":
        from governor.operator.crds import main as crds_main

        return crds_main(args[1:])
    if args[0] in ENGINE_COMMANDS:
        from governor.engine.cli import main as engine_main

        return engine_main(args)
    known = ", ".join((*ENGINE_COMMANDS, "tune", "demo", "crds", "operator"))
    print(f"governor: unknown command {args[0]!r}; expected one of {known}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
