"""The torch backend's implementation of `keras.distribution`, by technique.

`keras/src/backend/torch/distribution_lib.py` is the interface generic Keras
code calls; the torch backend's own files hook into these packages:

- `core`: the job (process group, the distribution in effect), meshes and
  layouts as DTensor placements, variables, collectives over named mesh
  axes, random numbers drawn by position.
- `health`: bounded collectives, failed processes named, processes that
  disagree stopped before they hang.
- `training`: the step object run under the distribution, its gradient
  reductions, compiled steps, and the layer-call hook.
- `data_parallel`: per-sample models on each process' rows, with one
  process' numbers (batch moments, coupled layers, the loss).
- `tensor_parallel`: einsum, matmul and attention on each process' shards;
  the column/row pairing of a layout.
- `fsdp`: weights sharded over the batch axis, gathered per layer call.
- `dtensor_gaps`: what DTensor refuses or computes otherwise than one
  process does, each workaround in its own module.
- `inputs`: global batches from each process' share of the data.
- `checkpoints`: sharded checkpoints, and saving from one process.
"""
