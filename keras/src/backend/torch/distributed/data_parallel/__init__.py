"""Data parallelism on each process' rows: `local_rows` (a per-sample model on
plain tensors), `batch_coupling` (probes the first call for what couples
samples), `coupled_layers` (those layers alone, through DTensor),
`batch_statistics` (global-batch moments), `local_loss` (per-sample losses).
"""
