"""Prompt-lookup drafts: propose the tokens that followed the most recent earlier copy of the current suffix.

`propose_ngram` searches the whole sequence at every call, O(L · max_n) for a sequence of L tokens: the definition,
and the oracle of the tests. The engine keeps an `NgramIndex` per sequence instead, fed each token once as it
arrives, so that a step's proposal costs O(max_n) however long the context (2.3–3.2 µs a sequence on a CPU core,
where the search took 95–97 µs at 4,096 tokens), for about 0.55 KiB of host memory a token at max_n 4
(docs/performance/speculative-decoding.md).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens copied from an earlier occurrence of the sequence's last n tokens.

    With L = len(token_ids) and s = token_ids, an occurrence of the n-suffix is a start i with
    s[i:i+n] == s[L-n:] and i + n <= L - 1 (it ends before the last token, so it is not the suffix
    itself; it may overlap it). The chosen n is the largest in [min_n, max_n] that has an occurrence,
    the chosen i is the most recent (largest) one, and the proposal is s[i+n : i+n+k]: at least one
    token, fewer than k when the sequence ends first. Returns [] when k == 0 or no n matches.

    Cost is O(L * max_n) in numpy: for every earlier end position e it counts how many tokens of
    s[:e+1] agree with the end of s, backwards, stopping at max_n.
    """
    if k < 0 or min_n < 1 or max_n < min_n:
        raise ValueError(f"propose_ngram needs k >= 0 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, "
                         f"max_n={max_n}")
    length = len(token_ids)
    max_n = min(max_n, length - 1)  # an earlier occurrence of an n-suffix needs L >= n + 1
    if k == 0 or max_n < min_n:
        return []
    seq = np.asarray(token_ids, dtype=np.int64)
    ends = np.arange(length - 1)  # e: last position of a candidate occurrence, before the final token
    # match_len[e] = number of d in 0.. with seq[e - d] == seq[L - 1 - d] for all smaller d, capped at max_n.
    match_len = np.zeros(length - 1, dtype=np.int64)
    alive = np.ones(length - 1, dtype=bool)
    for d in range(max_n):
        back = ends - d
        alive &= (back >= 0) & (seq[np.maximum(back, 0)] == seq[length - 1 - d])
        if not alive.any():
            break
        match_len += alive
    n = int(match_len.max())
    if n < min_n:
        return []
    e = int(np.flatnonzero(match_len == n)[-1])  # most recent occurrence of the longest matching suffix
    return seq[e + 1 : e + 1 + k].tolist()


_ONE_BY_ONE = 8  # `NgramIndex.extend` indexes up to this many new tokens one by one, more in bulk


class NgramIndex:
    """The most recent end of every n-gram of one sequence (min_n ≤ n ≤ max_n), kept as its tokens arrive:
    `propose` gives what `propose_ngram` gives on the same tokens, in O(max_n).

    Invariant: `last_end[g]` is the largest e ≤ length − 2 with tokens[e − n + 1 : e + 1] == g (n = len(g)), for
    every such n-gram g; an n-gram ending at the last token is indexed only once another token follows, so the
    suffix never finds itself. `tail` holds the last max_n tokens."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"NgramIndex needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.length = 0
        self.tail: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append the sequence's next tokens: index the n-grams ending at the current last token through the
        second-to-last new one. A step's few tokens go one by one (2-3 µs a token); a prompt's many are sliced and
        zipped (in C), about 0.6 µs a token."""
        if len(tokens) <= _ONE_BY_ONE:
            for token in tokens:
                end = self.length - 1
                for n in range(self.min_n, min(self.max_n, self.length) + 1):
                    self.last_end[tuple(self.tail[-n:])] = end
                self.tail.append(token)
                if len(self.tail) > self.max_n:
                    del self.tail[0]
                self.length += 1
            return
        seq = self.tail + list(tokens)
        base = self.length - len(self.tail)  # the position of seq[0] in the sequence
        last = len(seq) - 2  # the newest end that becomes indexable
        for n in range(self.min_n, self.max_n + 1):
            first = max(len(self.tail) - 1, n - 1)  # the oldest end not yet indexed that has n tokens
            if last >= first:
                grams = zip(*(seq[first - n + 1 + i:last - n + 2 + i] for i in range(n)), strict=True)
                self.last_end.update(zip(grams, range(base + first, base + last + 1), strict=True))  # later win
        self.tail = seq[-self.max_n:]
        self.length += len(tokens)

    def match(self) -> int | None:
        """The end e of the most recent earlier occurrence of the longest suffix that has one (None: none does);
        the proposal is the tokens at e + 1, e + 2, ..."""
        for n in range(min(self.max_n, self.length - 1), self.min_n - 1, -1):
            end = self.last_end.get(tuple(self.tail[-n:]))
            if end is not None:
                return end
        return None
