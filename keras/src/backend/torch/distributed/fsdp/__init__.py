"""Weights sharded over the batch axis (FSDP-style): `fsdp` (which weights,
gathered around each layer call), `fsdp_call` (a call on gathered weights),
`fsdp_gather` (bucketed gathers and reduce-scatters), `fsdp_schedule` (the
gather order learned from one step, for prefetch in the next).
"""
