"""Checks that the processes agree before they can hang: processes building
different models issue different collectives, which one small one catches."""

import hashlib

import torch.distributed as dist

from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import runtime


def check_same_variable(path, shape, dtype):
    """Raises on every process if the processes create different variables."""
    description = f"'{path}' (shape {tuple(shape)}, dtype {dtype})"
    descriptions = gather_if_different(description)
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


def gather_if_different(text):
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
