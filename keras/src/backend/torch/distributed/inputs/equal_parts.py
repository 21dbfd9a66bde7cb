"""Each process' own data (`auto_shard_dataset=False`) whose batches have the
same sizes on every process, agreed once as iterating starts: its global
batches are assembled without exchanging their sizes at each step."""

import weakref

import torch

from keras.src.backend.torch.distributed.inputs import data_input
from keras.src.backend.torch.distributed.inputs import data_parts
from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter
from keras.src.trainers.data_adapters.torch_data_loader_adapter import (
    TorchDataLoaderAdapter,
)

# The adapters whose `batch_sizes` every process gave alike (`agree`).
_AGREED = weakref.WeakSet()


def batch_sizes(adapter):
    """`(full, last, count)`: `count` batches, all of `full` rows but the last,
    of `last`, in this order by construction of `adapter`; else `None`."""
    if type(adapter) is ArrayDataAdapter:
        full = adapter.batch_size
        return full, adapter.partial_batch_size or full, adapter.num_batches
    if type(adapter) is not TorchDataLoaderAdapter:
        return None
    loader = adapter.get_torch_dataloader()
    sampler = loader.batch_sampler
    if (
        type(sampler) is not torch.utils.data.BatchSampler
        or loader.collate_fn is not torch.utils.data.default_collate
        or isinstance(loader.dataset, torch.utils.data.IterableDataset)
        or not hasattr(sampler.sampler, "__len__")
    ):
        return None
    count, rest = divmod(len(sampler.sampler), sampler.batch_size)
    if rest and not sampler.drop_last:
        return sampler.batch_size, rest, count + 1
    return sampler.batch_size, sampler.batch_size, count


def agree(adapter):
    """Records that every process gave `adapter`'s `batch_sizes` alike."""
    _AGREED.add(adapter)


def own_batches(adapter, distribution):
    """`adapter` yielding global batches assembled without a collective if
    every process agreed on its batches' sizes, else `None`."""
    if adapter not in _AGREED:
        return None
    return EqualParts(adapter, distribution)


class EqualParts(data_parts.SharedAdapter):
    """Each batch is this process' part of a global batch whose parts along
    the batch axis all have its size."""

    def __init__(self, adapter, distribution):
        super().__init__(adapter, distribution)
        self._sizes = batch_sizes(adapter)
        mesh = distribution.device_mesh.backend_mesh
        axis = mesh.mesh_dim_names.index(distribution.batch_dim_name)
        self._parts = mesh.size(axis)

    def get_torch_dataloader(self):
        return self  # Iterable: every iteration is a fresh pass.

    def __iter__(self):
        full, last, count = self._sizes
        for index, rows in enumerate(self._adapter.get_torch_dataloader()):
            size = last if index == count - 1 else full
            # Checks that every array of `rows` has the agreed size.
            yield data_input.global_batch(
                rows, size * self._parts, self._distribution, size
            )
