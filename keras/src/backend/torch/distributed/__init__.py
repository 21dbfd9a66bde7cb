"""The torch backend's implementation of `keras.distribution`, by concern.

`keras/src/backend/torch/distribution_lib.py` is the interface generic Keras
code calls; the torch backend's own files hook into these modules directly:

- `runtime`: the job (process group, world size, torch version), the
  distribution in effect, random state agreed across processes, debug logs.
- `layouts`: Keras meshes and layouts as torch meshes and DTensor
  placements, and the sharding rules shared by the other modules.
- `variables`: variables created, assigned and read under a distribution.
- `layer_call`: layer calls: plain tensors as replicated global values,
  row-parallel outputs reduced.
- `ops`: convolution, reshape and `take` on DTensors, as one process
  computes them.
- `shard_local`: einsum, batched matmul and attention on each process'
  shards, where they split as tensor parallelism splits them.
- `fallback`: ops DTensor refuses, computed on global values.
- `refused_on_rows`: of those, the per-sample ones on a batch-sharded
  operand, computed on each process' rows after a check.
- `local_rows`: data-parallel models called on each process' own rows.
- `coupled_layers`: the layers of such a model that couple samples,
  called alone through DTensor.
- `batch_coupling`: whether a call couples the samples of a batch (the
  probe of its first call), which decides that path.
- `data_input`: global batches assembled from each process' rows.
- `data_sources`: `DataLoader`s and `PyDataset`s read one process' share.
- `collectives`: `all_reduce` / `all_gather` over a named mesh axis.
- `gradients`: gradients reduced once per step, in buckets, for the
  optimizer.
- `step`: the training step as one object (`DistributedStep`): a step
  function of the trainer run under the distribution.
- `compiled_step`: steps compiled by `torch.compile` on `DTensor`s.
- `process_io`: printing and saving from one process.
- `summary`: what a distribution stores on this process.
- `health`: collectives bounded by timeouts; a failed, dead or frozen
  process reported by name instead of a transport error.
- `agreement`: processes that disagree (model, number of batches) stopped
  with a `ValueError` before they can hang.
- `call_agreement`: collective calls a user makes (reading a sharded
  value, `fit`, saving) agreed in the job's store, so that a call made on
  some processes only stops them with a `ValueError` instead of pairing
  with another collective.
- `layout_rules`: which `LayoutMap` rule lays out each variable; a warning
  for rules that lay out none.
"""
