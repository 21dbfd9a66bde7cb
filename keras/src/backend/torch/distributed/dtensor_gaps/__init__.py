"""Workarounds for what DTensor refuses or computes unlike one process."""
