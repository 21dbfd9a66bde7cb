"""What DTensor refuses or computes otherwise than one process does, each
workaround naming the torch behaviour it stands in for."""
