"""The training step and the layer-call hook under a distribution.

`step` runs the trainer's step functions (`DistributedStep`);
`step_reduction` overlaps the gradient reduction with the backward pass;
`gradients` reduces gradients once per step, in buckets; `compiled_step`
compiles steps with `torch.compile` on DTensors; `layer_call` takes plain
tensors as replicated global values and reduces row-parallel outputs.
"""
