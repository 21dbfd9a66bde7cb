"""Data sources under a distribution: each process reads only its rows.

Instead of every process reading the whole global batch and keeping its rows
(`data_input.distribute_global_batch`), two sources are read in parts, yielding
global `DTensor` batches (shared code: `data_parts`): a map-style `DataLoader`
with a batch sampler (`loader_rows`: each process fetches its rows of the
loader's index batches, with its workers and `collate_fn`) and a finite
`PyDataset` (`pydataset_shares`: processes take turns reading whole batches and
send each process its rows). Other sources and `auto_shard_dataset=False` keep
the default path.
"""

import torch

from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.inputs import loader_rows
from keras.src.backend.torch.distributed.inputs import pydataset_shares
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter
from keras.src.trainers.data_adapters.torch_data_loader_adapter import (
    TorchDataLoaderAdapter,
)


def process_data_adapter(adapter):
    """Returns an adapter that reads only this process' share of the data.

    Args:
        adapter: the `DataAdapter` Keras made for the input.

    Returns:
        `adapter` itself without a multi-process distribution sharding the data
        (`auto_shard_dataset=True`) or for a source not readable in parts; else
        an adapter yielding global `DTensor` batches.
    """
    distribution = runtime.current_distribution()
    if (
        distribution is None
        or not distribution.auto_shard_dataset
        or runtime.world_size() == 1
    ):
        return adapter
    if isinstance(adapter, TorchDataLoaderAdapter) and _is_batched_map_loader(
        adapter.get_torch_dataloader()
    ):
        return loader_rows.DataLoaderRows(adapter, distribution)
    if isinstance(adapter, PyDatasetAdapter) and adapter.num_batches:
        return pydataset_shares.PyDatasetShares(adapter, distribution)
    return adapter


def _is_batched_map_loader(loader):
    return loader.batch_sampler is not None and not isinstance(
        loader.dataset, torch.utils.data.IterableDataset
    )
