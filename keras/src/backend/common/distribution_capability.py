"""Lookup, by name, of `distribution_lib` functions only some backends have
(e.g. saving from one process); generic code keeps its own behaviour where
the backend has none."""


def distribution_capability(name):
    """Returns the backend's implementation of a distribution capability.

    Args:
        name: a function name of the backend's `distribution_lib`, e.g.
            `"save_from_one_process"`.

    Returns:
        The function, or `None` if the backend does not provide it.
    """
    from keras.src.backend import distribution_lib

    return getattr(distribution_lib, name, None)
