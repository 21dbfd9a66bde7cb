"""Tensor parallelism: ops computed on each process' shards.

- `shard_local`: einsum, batched matmul and attention on each process'
  shards, where they split as tensor parallelism splits them.
- `pairing_check`: the column/row pairs a layout must keep together
  (`AutoModelParallel`'s plans and the check of a user's layout).
"""
