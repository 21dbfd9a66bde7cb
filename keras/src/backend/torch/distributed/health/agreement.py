"""Checks that the processes of a job agree, before they can hang: processes
that build different models or iterate over different numbers of batches
issue different collectives, which one small collective catches first."""

import hashlib

import torch.distributed as dist

from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import runtime


def check_same_variable(path, shape, dtype):
    """Raises on every process if the processes create different variables
    (`path`, `shape`, `dtype`)."""
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
    """Raises on every process if their `num_batches` (or `steps_per_epoch`,
    `None` if unknown) differ: global batches as well as each process' own
    (a dataset whose length each process computes may differ)."""
    distribution = runtime.current_distribution()
    if runtime.world_size() == 1 or distribution is None:
        return
    counts = _gather_if_different(str(num_batches))
    if counts is None:
        if num_batches is None and not distribution.auto_shard_dataset:
            raise ValueError(
                "With `auto_shard_dataset=False` each process iterates over "
                "its own data, whose number of batches is unknown here (a "
                "generator, or a dataset of unknown cardinality): a process "
                "whose data ends first would pair its next steps with the "
                "others' steps. Pass the same `steps_per_epoch` (and "
                "`validation_steps`) on every process."
            )
        return
    per_process = ", ".join(f"process {i}: {n}" for i, n in enumerate(counts))
    raise ValueError(
        "Every process must iterate over the same number of batches (every "
        f"step needs every process). Received: {per_process} batches "
        "('None' is unknown). Give every process as many batches (the same "
        "global data; with `auto_shard_dataset=False`, e.g. drop the "
        "remainder), or pass the same `steps_per_epoch` (and "
        "`validation_steps`) on every process."
    )


def _gather_if_different(text):
    """`text` from every process, or `None` if all agree (one all-gather of a
    digest; the texts are gathered only if they differ)."""
    if runtime.world_size() == 1:
        return None
    digest = hashlib.blake2b(text.encode(), digest_size=7).digest()
    digests = collectives.all_gather_ints([int.from_bytes(digest, "big")], None)
    if all(d == digests[0] for d in digests):
        return None
    texts = [None] * runtime.world_size()
    dist.all_gather_object(texts, text)
    return texts
