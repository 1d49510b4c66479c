"""Content hashes of full KV blocks, chained so a block's hash names its whole prefix.

The chain is seeded with the identity of what produced the KV: model digest, tokenizer digest,
adapter, KV cache dtype and the request's cache salt. Requests with different salts (tenants) never
share a block; a different model or KV dtype never reuses stale blocks.
"""

from __future__ import annotations

import hashlib
from array import array


def identity_seed(model_digest: str, tokenizer_digest: str, adapter: str, kv_dtype: str,
                  cache_salt: str | None) -> bytes:
    parts = (model_digest, tokenizer_digest, adapter, kv_dtype, cache_salt or "")
    return hashlib.sha256("\0".join(parts).encode()).digest()


def chain_hashes(parent: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """Hashes of each full block of `token_ids`, the first chained to `parent`."""
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", token_ids[start:start + block_size]).tobytes()).digest()
        out.append(parent)
    return out
