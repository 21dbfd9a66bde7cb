"""Data parallelism with one process' numbers, on each process' rows.

`local_rows` calls a per-sample model on each process' rows as plain tensors;
`batch_coupling` probes a model's first call to decide that path and find what
couples samples; `coupled_layers` calls those layers alone through DTensor;
`batch_statistics` computes batch moments over the global batch; `local_loss`
applies a per-sample loss to each process' rows.
"""
