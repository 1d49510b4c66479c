"""Host time of an n-gram proposal per sequence and step, by context length: the whole-context search
(`propose_ngram`) against the per-sequence index the engine keeps (`NgramIndex`: the step's new token, then the
match), and the index's one-time cost of taking a whole prompt.

    PYTHONPATH=engine:kernels:operator python3 scripts/ngram-proposal-cost.py [--lengths 512,4096,16384]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from governor.engine.spec.ngram import NgramIndex, propose_ngram

STEPS = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,4096,16384")
    parser.add_argument("--max-n", type=int, default=4, help="prompt_lookup_max (the engine's default: 4)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("context | search µs/step | index µs/step | index, whole prompt ms")
    for length in (int(x) for x in args.lengths.split(",")):
        tokens = rng.integers(0, 32_000, size=length + STEPS).tolist()
        start = time.perf_counter()
        for i in range(STEPS):
            propose_ngram(tokens[:length + i], 4, 1, args.max_n)
        search = (time.perf_counter() - start) / STEPS * 1e6
        index = NgramIndex(1, args.max_n)
        start = time.perf_counter()
        index.extend(tokens[:length])
        whole = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        for i in range(STEPS):
            index.extend(tokens[length + i:length + i + 1])
            index.match()
        per_step = (time.perf_counter() - start) / STEPS * 1e6
        print(f"{length} | {search:.1f} | {per_step:.1f} | {whole:.2f}")


if __name__ == "__main__":
    main()
