"""Weights sharded over the batch axis, gathered around each layer call."""
