"""What the data sources read in parts (`data_sources`) share. Each yields
global batches as `DTensor`s, of which this process read only its rows."""

import numpy as np

from keras.src import tree
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.trainers.data_adapters.data_adapter import DataAdapter


def _delegated(name):
    """The wrapped adapter's attribute `name`, as a property."""
    return property(lambda self: getattr(self._adapter, name))


class SharedAdapter(DataAdapter):
    """Delegates to the adapter Keras made; subclasses yield the batches."""

    num_batches = _delegated("num_batches")
    batch_size = _delegated("batch_size")
    has_partial_batch = _delegated("has_partial_batch")
    partial_batch_size = _delegated("partial_batch_size")
    get_numpy_iterator = _delegated("get_numpy_iterator")
    get_jax_iterator = _delegated("get_jax_iterator")
    get_tf_dataset = _delegated("get_tf_dataset")
    on_epoch_begin = _delegated("on_epoch_begin")
    on_epoch_end = _delegated("on_epoch_end")

    def __init__(self, adapter, distribution):
        self._adapter = adapter
        self._distribution = distribution
        self._rows = batch_rows(distribution)


def batch_rows(distribution):
    """`rows(global_size, rank=None)`: the `(start, stop)` of the rows of a
    global batch process `rank` (default: this one) holds."""
    mesh = distribution.device_mesh.backend_mesh
    batch_dim = mesh.mesh_dim_names.index(distribution.batch_dim_name)
    parts = {  # The batch-axis coordinate of every rank of the job.
        int(mesh.mesh[index]): index[batch_dim]
        for index in np.ndindex(*mesh.mesh.shape)
    }

    def rows(global_size, rank=None):
        part = parts[runtime.rank() if rank is None else rank]
        return layouts.chunk_bounds(global_size, mesh.size(batch_dim), part)

    return rows


def take_rows(batch, start, stop):
    def take(x):
        if x is None or np.ndim(x) == 0:
            return x
        return (x if hasattr(x, "shape") else np.asarray(x))[start:stop]

    return tree.map_structure(take, batch)


def batch_size(batch):
    for x in tree.flatten(batch):
        if x is not None and np.ndim(x) > 0:
            return len(x)
    raise ValueError(
        "A batch of the dataset holds no array with a batch dimension. "
        f"Received: {str(batch)[:100]}"
    )


def check_rows(rows, local_size):
    for x in tree.flatten(rows):
        if x is not None and np.ndim(x) > 0 and len(x) != local_size:
            raise ValueError(
                "All inputs of a batch must have the same batch size. "
                f"Received sizes {local_size} and {len(x)}."
            )
