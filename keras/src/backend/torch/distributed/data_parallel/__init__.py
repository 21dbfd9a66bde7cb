"""Data parallelism on each process' rows, as plain tensors."""
