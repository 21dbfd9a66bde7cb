"""Data sources read in parts, a batched map-style `DataLoader` (`loader_rows`)
and a finite `PyDataset` (`pydataset_shares`): each process reads its rows;
each process' own data in parts of agreed sizes (`equal_parts`)."""

import torch

from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.inputs import equal_parts
from keras.src.backend.torch.distributed.inputs import loader_rows
from keras.src.backend.torch.distributed.inputs import pydataset_shares
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter
from keras.src.trainers.data_adapters.torch_data_loader_adapter import (
    TorchDataLoaderAdapter,
)


def process_data_adapter(adapter):
    """`adapter`, or one reading only this process' share of its data where a
    multi-process distribution shards it and the source can be read in parts
    (or, where each process reads its own, agreed on their sizes)."""
    distribution = runtime.current_distribution()
    if distribution is None or runtime.world_size() == 1:
        return adapter
    if not distribution.auto_shard_dataset:
        return equal_parts.own_batches(adapter, distribution) or adapter
    if isinstance(adapter, TorchDataLoaderAdapter):
        loader = adapter.get_torch_dataloader()
        if loader.batch_sampler is not None and not isinstance(
            loader.dataset, torch.utils.data.IterableDataset
        ):
            return loader_rows.DataLoaderRows(adapter, distribution)
    if isinstance(adapter, PyDatasetAdapter) and adapter.num_batches:
        return pydataset_shares.PyDatasetShares(adapter, distribution)
    return adapter
