"""How generic Keras code asks the backend for an optional distribution
capability.

Backends implement `keras.distribution` in their `distribution_lib` module
(some backends have none). Beyond the functions every implementation has,
generic code calls a few that only some backends need, such as writing a
file from one process of a multi-process job. It asks for them here, by
name, and keeps its own behaviour where the backend has none.
"""


def distribution_capability(name):
    """Returns the backend's implementation of a distribution capability.

    Args:
        name: the name of a function of the backend's `distribution_lib`,
            e.g. `"save_from_one_process"`.

    Returns:
        The function, or `None` if the backend does not provide it.
    """
    from keras.src.backend import distribution_lib

    return getattr(distribution_lib, name, None)
