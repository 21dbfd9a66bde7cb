"""Lookup of `distribution_lib` functions only some backends have."""


def distribution_capability(name):
    """The backend's `distribution_lib` function `name`, or `None`."""
    from keras.src.backend import distribution_lib

    return getattr(distribution_lib, name, None)
