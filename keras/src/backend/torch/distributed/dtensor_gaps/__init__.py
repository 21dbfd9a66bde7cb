"""What DTensor refuses or computes otherwise than one process does.

Each workaround names the torch behaviour it stands in for, to be deleted
when the minimum torch has the fix.

- `fallback`: ops DTensor refuses, computed on global values.
- `refused_on_rows`: of those, per-sample ones on a batch-sharded operand,
  computed on each process' rows after a check.
- `global_values`: an op on its operands' global values, laid out again.
- `linear_partials`: ops linear in an operand computed on its partial sums.
- `sharded_positions`: `argmax`-like reductions over a sharded dimension.
- `ops`: convolution, reshape and `take` on DTensors.
"""
