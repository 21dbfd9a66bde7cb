"""Tensor parallelism: `shard_local` (einsum, batched matmul and attention on
local shards), `pairing_check` (column/row pairs a layout must keep)."""
