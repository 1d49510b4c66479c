"""Speculative decoding: cheap draft proposals and the verifier that keeps the target's distribution exact."""
