"""`tf.data` input under a multi-process distribution: sharded upstream's way
if its static batch size splits evenly, else read whole by every process, which
keeps its rows (so it must yield the same batches everywhere: seed shuffles)."""

from keras.src import tree
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.inputs import data_input
from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter


def tf_dataset_adapter(dataset, class_weight=None, distribution=None):
    """The `TFDatasetAdapter` of `dataset`; sharded, it yields global
    `DTensor` batches assembled from this process' parts."""
    if not (
        distribution is not None
        and runtime.world_size() > 1
        and getattr(distribution, "auto_shard_dataset", False)
    ):
        return TFDatasetAdapter(
            dataset, class_weight=class_weight, distribution=distribution
        )
    adapter = TFDatasetAdapter(dataset, class_weight=class_weight)
    batch_size = _shardable_batch_size(adapter.get_tf_dataset(), distribution)
    if batch_size is None:
        runtime.log_debug("tf.data input: read as global batches")
        return adapter
    runtime.log_debug("tf.data input: sharded, global batch %d", batch_size)
    return _ProcessPartsAdapter(dataset, class_weight, distribution, batch_size)


def _shardable_batch_size(dataset, distribution):
    """The global batch size if upstream's part `data_shard_id` is this
    process' rows (batch-axis processes, batches split evenly), else `None`."""
    from tensorflow.python.data.experimental.ops import (
        distribute as tf_data_distribute,
    )

    sizes = {
        spec.shape[0] if getattr(spec, "shape", None) else None
        for spec in tree.flatten(dataset.element_spec)
    }
    if len(sizes) != 1 or None in sizes:
        return None
    (batch_size,) = sizes
    if int(tf_data_distribute.compute_batch_size(dataset)) != batch_size:
        return None
    mesh = distribution.device_mesh.backend_mesh
    batch_dim = mesh.mesh_dim_names.index(distribution.batch_dim_name)
    num_parts = mesh.size(batch_dim)
    if (
        batch_size % num_parts
        or distribution.num_model_replicas != num_parts
        or distribution.data_shard_id != mesh.get_coordinate()[batch_dim]
    ):
        return None
    return batch_size


class _ProcessPartsAdapter(TFDatasetAdapter):
    """Reads this process' parts, yields global `DTensor` batches."""

    def __init__(self, dataset, class_weight, distribution, batch_size):
        super().__init__(
            dataset, class_weight=class_weight, distribution=distribution
        )
        self._distribution = distribution
        self._global_batch_size = batch_size

    batch_size = property(lambda self: self._global_batch_size)

    def get_torch_dataloader(self):
        return self  # Iterable: every iteration is a fresh pass.

    def __iter__(self):
        for part in super().get_torch_dataloader():
            yield data_input.global_batch(
                part, self._global_batch_size, self._distribution
            )
