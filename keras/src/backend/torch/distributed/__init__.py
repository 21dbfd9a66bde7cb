"""The torch backend's implementation of `keras.distribution`, by technique.

`keras/src/backend/torch/distribution_lib.py` is the interface generic Keras
code calls; the torch backend's files hook into these packages:

- `core`: process group, meshes and layouts as DTensor placements, variables,
  collectives over named mesh axes, position-based random numbers.
- `health`: bounded collectives; failed processes named, processes that
  disagree stopped before they hang.
- `training`: the distributed step, gradient reductions, compiled steps,
  the layer-call hook.
- `data_parallel`: per-sample models on each process' rows, with batch
  moments, coupled layers and the loss as one process computes them.
- `tensor_parallel`: einsum, matmul and attention on shards.
- `fsdp`: weights sharded over the batch axis, gathered per layer call.
- `dtensor_gaps`: workarounds, one per module, for what DTensor refuses
  or computes differently from one process.
- `inputs`: global batches from each process' share of the data.
- `checkpoints`: sharded checkpoints, and saving from one process.
"""
