"""Data parallelism on each process' rows: a per-sample model and its loss
computed on plain tensors, what couples samples through DTensor."""
