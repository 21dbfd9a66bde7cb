"""Weights sharded over the batch axis (FSDP-style).

- `fsdp`: which weights, and their gathers around each layer call.
- `fsdp_call`: a layer's call on its gathered weights.
- `fsdp_gather`: gathers and reduce-scatters, in buckets.
- `fsdp_schedule`: gather order learned from one step for the next (prefetch).
"""
