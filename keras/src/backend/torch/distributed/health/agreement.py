"""Checks that the processes of a job agree, before they can hang.

Processes that build different models, or iterate over different numbers
of batches, issue different collectives: one waits for a collective the
others never start, or a transport error ends the job. Here they compare
what they are about to do, in one small collective, and every process
raises the same `ValueError` naming what differs.
"""

import hashlib

import torch.distributed as dist

from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import runtime


def check_same_variable(path, shape, dtype):
    """Raises on every process if the processes create different variables.

    Called before each variable is broadcast from process 0, so that the
    first variable that differs is the one named.

    Args:
        path: the variable's path, e.g. `"sequential/dense/kernel"`.
        shape: the variable's shape.
        dtype: the variable's dtype.
    """
    description = f"'{path}' (shape {tuple(shape)}, dtype {dtype})"
    descriptions = _gather_if_different(description)
    if descriptions is None:
        return
    first = descriptions[0]
    other = next(i for i, d in enumerate(descriptions) if d != first)
    raise ValueError(
        "The processes of the job build different models: process 0 "
        f"creates the variable {first} where process {other} creates "
        f"{descriptions[other]}. Every process must build the same model "
        "(same layers, in the same order, with the same shapes and "
        "dtypes); check code that depends on the process (e.g. on "
        "`keras.distribution.process_id()`) or on files or arguments that "
        "differ between machines."
    )


def check_same_num_batches(num_batches):
    """Raises on every process if they have different numbers of batches.

    With `auto_shard_dataset=False` every process iterates over its own
    data; each step needs every process, so they must have as many
    batches (`None`: unknown, e.g. a generator).

    Args:
        num_batches: the number of batches of this process' data (or the
            `steps_per_epoch` it was given), or `None`.
    """
    distribution = runtime.current_distribution()
    if (
        runtime.world_size() == 1
        or distribution is None
        or distribution.auto_shard_dataset
    ):
        return
    counts = _gather_if_different(str(num_batches))
    if counts is None:
        return
    per_process = ", ".join(f"process {i}: {n}" for i, n in enumerate(counts))
    raise ValueError(
        "With `auto_shard_dataset=False` every process must iterate over "
        "the same number of batches (every step needs every process). "
        f"Received: {per_process} batches ('None' is unknown). Give every "
        "process as many batches (e.g. drop the remainder), or pass the "
        "same `steps_per_epoch` (and `validation_steps`) on every process."
    )


def _gather_if_different(text):
    """Gathers `text` from every process if they do not all have the same.

    One all-gather of a digest when they agree; a second, of the texts
    themselves, only when they differ.

    Returns:
        The texts in process order, or `None` if all are the same.
    """
    if runtime.world_size() == 1:
        return None
    digest = hashlib.blake2b(text.encode(), digest_size=7).digest()
    digests = collectives.all_gather_ints([int.from_bytes(digest, "big")], None)
    if all(d == digests[0] for d in digests):
        return None
    texts = [None] * runtime.world_size()
    dist.all_gather_object(texts, text)
    return texts
