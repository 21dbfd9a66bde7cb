"""Weights sharded over the batch axis, gathered around each layer call
(FSDP-style), with bucketed collectives and prefetch.
"""
