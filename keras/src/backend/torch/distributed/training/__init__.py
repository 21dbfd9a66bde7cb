"""The training step under a distribution, its reductions and layer calls."""
