"""Saving and loading under a distribution.

`checkpoint`: sharded checkpoints (torch's DCP), complete or ignored;
`process_io`: printing and saving from one process.
"""
