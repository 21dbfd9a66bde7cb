"""Saving and loading under a distribution: `checkpoint` (sharded checkpoints
with torch's DCP, complete or ignored), `process_io` (one process prints/saves).
"""
