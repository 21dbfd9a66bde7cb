"""Tensor parallelism: ops computed on each process' shards.

- `shard_local`: einsum, batched matmul and attention on local shards.
- `pairing_check`: the column/row pairs a layout must keep together.
"""
