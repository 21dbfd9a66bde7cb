"""The torch backend's `keras.distribution`, by technique, under the interface
`keras/src/backend/torch/distribution_lib.py`: `core` (process group, meshes,
layouts as DTensor placements, variables, collectives, position-based random
numbers), `health` (bounded collectives, failed processes named, disagreeing
ones stopped before they hang), `training` (the distributed step, gradient
reductions, compiled steps, the layer-call hook), `data_parallel` (per-sample
models on each process' rows), `tensor_parallel` (einsum, matmul and attention
on shards), `fsdp` (weights sharded over the batch axis, gathered per layer
call), `dtensor_gaps` (workarounds for what DTensor refuses or computes
differently from one process), `inputs` (global batches from each process' share
of the data), `checkpoints` (sharded checkpoints, saving from one process).
"""
