"""Saving and loading under a distribution: sharded checkpoints (`checkpoint`)
and single-file saves from one process (`process_io`)."""
