"""The training step and the layer-call hook under a distribution: `step`
(the trainer's step functions), `step_reduction` (gradient reduction during
the backward pass), `gradients` (reduced once per step, in buckets),
`compiled_step` (`torch.compile` on DTensors), `layer_call` (plain tensors
as replicated global values, row-parallel outputs reduced)."""
