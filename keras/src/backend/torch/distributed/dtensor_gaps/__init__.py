"""What DTensor refuses or computes otherwise than one process does; each
workaround names the torch behaviour it stands in for, to delete with a fix.
"""
