"""What DTensor refuses or computes otherwise than one process does; each
workaround names the torch behaviour it stands in for, to delete with a fix.

`fallback`: refused ops on global values (`refused_on_rows`: per-sample ones
on each process' rows); `global_values`: an op on global values, laid out
again; `linear_partials`: ops linear in an operand, on its partial sums;
`sharded_positions`: `argmax`-like reductions over a sharded dimension;
`ops`: convolution, reshape and `take` on DTensors.
"""
