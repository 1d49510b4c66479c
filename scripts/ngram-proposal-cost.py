"""Host time of an n-gram proposal per sequence and step, by context length: the whole-context search
(`propose_ngram`, on a copy of the context as the engine would pass it) against the per-sequence index the engine
keeps (`NgramIndex`: the step's new token, then the match, after WARM untimed steps), and the index's one-time cost
of taking a whole prompt and the memory it holds.

    PYTHONPATH=engine:kernels:operator python3 scripts/ngram-proposal-cost.py [--lengths 512,4096,16384]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from governor.engine.spec.ngram import NgramIndex, propose_ngram

STEPS = 200
WARM = 50


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,4096,16384")
    parser.add_argument("--max-n", type=int, default=4, help="prompt_lookup_max (the engine's default: 4)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("context | search µs/step | index µs/step | index, whole prompt ms | index peak memory KiB")
    for length in (int(x) for x in args.lengths.split(",")):
        tokens = rng.integers(0, 32_000, size=length + WARM + STEPS).tolist()
        start = time.perf_counter()
        for i in range(STEPS):
            propose_ngram(tokens[:length + i], 4, 1, args.max_n)
        search = (time.perf_counter() - start) / STEPS * 1e6
        tracemalloc.start()  # the memory, in a pass of its own (tracing slows what it traces)
        NgramIndex(1, args.max_n).extend(tokens[:length])
        memory = tracemalloc.get_traced_memory()[1] / 1024
        tracemalloc.stop()
        index = NgramIndex(1, args.max_n)
        start = time.perf_counter()
        index.extend(tokens[:length])
        whole = (time.perf_counter() - start) * 1e3
        for i in range(WARM):
            index.extend(tokens[length + i:length + i + 1])
            index.match()
        start = time.perf_counter()
        for i in range(WARM, WARM + STEPS):
            index.extend(tokens[length + i:length + i + 1])
            index.match()
        per_step = (time.perf_counter() - start) / STEPS * 1e6
        print(f"{length} | {search:.1f} | {per_step:.1f} | {whole:.2f} | {memory:.0f}")


if __name__ == "__main__":
    main()
