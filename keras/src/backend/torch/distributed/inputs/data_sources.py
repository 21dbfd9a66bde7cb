"""Data sources under a distribution: each process reads only its rows.

Without this module every process reads the whole global batch and keeps
its rows of it (`data_input.distribute_global_batch`). Sources that can be
read in parts are read in parts instead:

- A map-style `torch.utils.data.DataLoader` with a batch sampler: every
  process draws the global batches of indices from the loader's own batch
  sampler (the order one process would see) and fetches only the samples
  of its rows, with the loader's own workers and `collate_fn` (without
  workers, one thread reads ahead). Processes that share rows (along the
  other mesh axes) fetch the same samples.
- A finite `keras.utils.PyDataset`, which returns whole batches: the
  processes take turns reading the batches one process would take, with
  the dataset's own workers, and each batch's rows are sent to the
  processes that hold them.

Both yield global batches as `DTensor`s, which the step takes as they are
(`loader_rows`, `pydataset_shares`; what they share: `data_parts`).
Other sources (generators, iterable datasets, infinite `PyDataset`s) and
`auto_shard_dataset=False` keep the default path.
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
        `adapter` itself without a multi-process distribution that shards
        the data (`auto_shard_dataset=True`), or for a source that cannot
        be read in parts; otherwise an adapter yielding global batches as
        `DTensor`s of which this process read only its share.
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
