"""Paged KV cache: the block pool (who owns which block) and the KV tensors."""
