"""Paged attention for a flattened batch: the metadata a step carries and the backend that runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from governor.kernels import paged_attention as kernels
from governor.kernels.launch_policy import LaunchPolicy, policy_for


@dataclass
class AttentionMetadata:
    """Where each token's KV goes and which cached context each sequence attends to.

    Sequences are ordered decodes first: the first `num_decodes` have exactly one query token.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each scheduled token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_decodes: int
    num_decode_tokens: int
    max_query_len: int
    prefill_query_start_loc: torch.Tensor  # [B - num_decodes + 1] int32, rebased to 0


class PagedAttention:
    """Writes this step's K/V into the cache, then attends over each sequence's paged context.

    backend "torch" is the plain-PyTorch reference (CPU); "triton" runs the decode kernel on the
    decode sequences and the varlen prefill kernel on the rest, with the launch settings `policy`: the one given,
    else the device's (`policy_for`), picked once, at the first call, and passed to every kernel after.
    """

    def __init__(self, backend: str, scale: float, policy: LaunchPolicy | None = None) -> None:
        if backend not in ("torch", "triton"):
            raise ValueError(f"attention backend must be 'torch' or 'triton', got {backend!r}")
        self.backend = backend
        self.scale = scale
        self.policy = policy

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """k_scale/v_scale: the layer's per-kv-head scales when the cache is fp8, else None."""
        k_cache, v_cache = kv_cache
        if self.backend == "torch":
            kernels.write_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
            return kernels.paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                               meta.query_start_loc, self.scale, k_scale=k_scale, v_scale=v_scale)
        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return self.attend(q, kv_cache, meta, k_scale, v_scale)

    def attend_rotary(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, *,
                      q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """A step of decodes only (one query a sequence): rotary, the K/V write and decode attention of the qkv
        projection in one launch (`rotary_decode_attention`; backend "triton" only)."""
        if self.backend != "triton" or meta.num_decode_tokens != qkv.shape[0]:
            raise RuntimeError("PagedAttention.attend_rotary takes steps of decodes only, on the Triton backend")
        policy = self.policy
        if policy is None:
            policy = self.policy = policy_for(qkv.device)
        return kernels.rotary_decode_attention(qkv, positions, cos_sin, num_heads, *kv_cache, meta.slot_mapping,
                                               meta.block_tables, meta.seq_lens, self.scale, q_norm=q_norm,
                                               k_norm=k_norm, eps=eps, k_scale=k_scale, v_scale=v_scale,
                                               policy=policy)

    def attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q over the cache, this step's K/V already written (backend "triton" only)."""
        if self.backend != "triton":
            raise RuntimeError("PagedAttention.attend runs the Triton kernels; the torch backend writes and "
                               "attends in one call")
        policy = self.policy
        if policy is None:
            policy = self.policy = policy_for(q.device)
        k_cache, v_cache = kv_cache
        out = torch.empty_like(q)
        nd, ndt = meta.num_decodes, meta.num_decode_tokens
        if nd:
            kernels.paged_decode_attention(q[:ndt], k_cache, v_cache, meta.block_tables[:nd],
                                           meta.seq_lens[:nd], self.scale, out=out[:ndt],
                                           k_scale=k_scale, v_scale=v_scale, policy=policy)
        if ndt < q.shape[0]:
            kernels.paged_prefill_attention(q[ndt:], k_cache, v_cache, meta.block_tables[nd:],
                                            meta.seq_lens[nd:], meta.prefill_query_start_loc,
                                            meta.max_query_len, self.scale, out=out[ndt:],
                                            k_scale=k_scale, v_scale=v_scale, policy=policy)
        return out
