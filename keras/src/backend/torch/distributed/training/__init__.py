"""The training step and the layer-call hook under a distribution.

- `step`: a step function of the trainer run under the distribution
  (`DistributedStep`).
- `step_reduction`: the step's reduction of gradients, overlapped with
  the backward pass.
- `gradients`: gradients reduced once per step, in buckets.
- `compiled_step`: steps compiled by `torch.compile` on DTensors.
- `layer_call`: layer calls: plain tensors as replicated global values,
  row-parallel outputs reduced.
"""
