"""Prompt-lookup drafts: propose the tokens that followed the most recent earlier copy of the current suffix."""

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
