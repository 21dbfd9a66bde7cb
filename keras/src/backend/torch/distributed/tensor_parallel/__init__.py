"""Tensor parallelism: shard-local einsum, matmul, attention; pairing checks."""
