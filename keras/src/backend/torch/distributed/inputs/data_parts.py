"""What the data sources read in parts (`data_sources`) share. Each yields
global batches as `DTensor`s, of which this process read only its rows."""

import numpy as np

from keras.src import tree
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.trainers.data_adapters.data_adapter import DataAdapter


class SharedAdapter(DataAdapter):
    """Delegates to the adapter Keras made; subclasses yield the batches."""

    num_batches = property(lambda self: self._adapter.num_batches)
    batch_size = property(lambda self: self._adapter.batch_size)
    has_partial_batch = property(lambda self: self._adapter.has_partial_batch)
    partial_batch_size = property(lambda self: self._adapter.partial_batch_size)

    def __init__(self, adapter, distribution):
        self._adapter = adapter
        self._distribution = distribution
        self._rows = BatchRows(distribution)

    def get_numpy_iterator(self):
        return self._adapter.get_numpy_iterator()

    def get_jax_iterator(self):
        return self._adapter.get_jax_iterator()

    def get_tf_dataset(self):
        return self._adapter.get_tf_dataset()

    def on_epoch_begin(self):
        self._adapter.on_epoch_begin()

    def on_epoch_end(self):
        self._adapter.on_epoch_end()


class BatchRows:
    """The rows of a global batch each process holds."""

    def __init__(self, distribution):
        mesh = distribution.device_mesh.backend_mesh
        batch_dim = mesh.mesh_dim_names.index(distribution.batch_dim_name)
        self.num_parts = mesh.size(batch_dim)
        # The batch-axis coordinate of every rank of the job.
        self.parts = {
            int(mesh.mesh[index]): index[batch_dim]
            for index in np.ndindex(*mesh.mesh.shape)
        }

    def of(self, global_size, rank=None):
        """`(start, stop)` of the rows of process `rank` (default: this)."""
        part = self.parts[runtime.rank() if rank is None else rank]
        return layouts.chunk_bounds(global_size, self.num_parts, part)


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
