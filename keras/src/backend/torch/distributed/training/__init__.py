"""The training step under a distribution (`step`), its gradient reductions
(`gradients`, `step_reduction`), compiled steps and the layer-call hook."""
