"""Data parallelism with one process' numbers, on each process' rows.

- `local_rows`: a model whose call is per-sample called on each process'
  rows as plain tensors.
- `batch_coupling`: the probe of a model's first call, which decides that
  path, and what couples samples.
- `coupled_layers`: the layers that couple samples, called alone through
  DTensor inside such a call.
- `batch_statistics`: batch moments over the global batch.
- `local_loss`: a per-sample loss on each process' rows.
"""
