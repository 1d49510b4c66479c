"""Tensor parallelism: process groups, weight sharding and the worker processes of ranks 1..N-1."""
