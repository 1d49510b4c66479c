"""Host time of detokenizing finished and streamed outputs, three ways (CPU).

    python3 scripts/decode-texts-bench.py TOKENIZER_DIR [--lists 256] [--tokens 1024] [--repeats 7]

`tokenizer.decode` per list (transformers), `governor.engine.tokenizer.decoder` per list (the engine's path: the Rust
tokenizer's decode directly for a plain fast tokenizer) and the Rust tokenizer's `decode_batch` over all lists, on
`--lists` lists of `--tokens` random ids (skip_special_tokens=True), median of `--repeats` rounds; then the same two
per-list ways on 20,000 lists of 6 ids (the incremental detokenizer's decodes of a streamed token). Checks that all
ways give the same strings.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from governor.engine.tokenizer import decoder, load_tokenizer


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer_dir")
    ap.add_argument("--lists", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer_dir)
    decode = decoder(tok)
    rng = random.Random(0)
    lists = [[rng.randrange(len(tok)) for _ in range(args.tokens)] for _ in range(args.lists)]
    short = [[rng.randrange(len(tok)) for _ in range(6)] for _ in range(20000)]
    want = [tok.decode(ids, skip_special_tokens=True) for ids in lists]
    assert [decode(ids, True) for ids in lists] == want
    if decode.__name__ == "rust":
        assert tok.backend_tokenizer.decode_batch(lists, skip_special_tokens=True) == want
    print(f"decoder path: {decode.__name__}; {args.lists} lists of {args.tokens} ids, median of {args.repeats}")
    hf_s = median_s(lambda: [tok.decode(i, skip_special_tokens=True) for i in lists], args.repeats)
    ours_s = median_s(lambda: [decode(i, True) for i in lists], args.repeats)
    print(f"  tokenizer.decode per list: {1e3 * hf_s:.1f} ms")
    print(f"  decoder per list:          {1e3 * ours_s:.1f} ms")
    if decode.__name__ == "rust":
        batch = median_s(lambda: tok.backend_tokenizer.decode_batch(lists, skip_special_tokens=True), args.repeats)
        print(f"  decode_batch:              {1e3 * batch:.1f} ms")
    n = len(short)
    hf = median_s(lambda: [tok.decode(i, skip_special_tokens=True) for i in short], 3)
    ours = median_s(lambda: [decode(i, True) for i in short], 3)
    print(f"6-id lists: tokenizer.decode {1e6 * hf / n:.2f} us, decoder {1e6 * ours / n:.2f} us each")


if __name__ == "__main__":
    main()
