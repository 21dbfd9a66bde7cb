"""Utilities for distribution strategy with the PyTorch backend.

A Keras `DeviceMesh` maps onto a torch `DeviceMesh` with one device per
process (torchrun's model) and a `TensorLayout` onto DTensor placements, so
values are sharded as the JAX backend shards them; a plain tensor stands for
a global value, as a plain array does in JAX. This is the interface generic
Keras code calls; the work is done in `keras.src.backend.torch.distributed`.
"""

import functools
import weakref

import numpy as np
import torch

from keras.src import tree
from keras.src.backend.torch.distributed.checkpoints import process_io
from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core import summary
from keras.src.backend.torch.distributed.core import variables
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.health import call_agreement
from keras.src.backend.torch.distributed.inputs import data_input
from keras.src.backend.torch.distributed.training import layer_call
from keras.src.backend.torch.distributed.training import step

# Distributions whose processes have agreed on torch's generator state.
_rng_agreed = weakref.WeakSet()

# Optional capabilities generic Keras code asks for (`distribution_capability`).
async_callbacks_supported = process_io.async_callbacks_supported
is_logging_process = process_io.is_logging_process
run_on_one_process = process_io.run_on_one_process
save_from_one_process = process_io.save_from_one_process
mesh_info = summary.mesh_info
sharding_summary = summary.sharding_summary
check_same_num_batches = call_agreement.check_same_num_batches
# The distribution in effect, also on threads that never set it.
current_distribution = runtime.current_distribution
# Collectives over a named mesh axis, as `jax.lax.psum` / `all_gather`.
all_reduce = collectives.all_reduce
all_gather = collectives.all_gather
# What the torch trainer calls: its step functions run as `DistributedStep`s.
DistributedStep = step.DistributedStep
loss_predictions = step.loss_predictions
local_loss = step.local_loss
metric_predictions = step.metric_predictions
reduce_gradients = step.reduce_gradients
local_metric_state = step.local_metric_state


def batch_step(model, kind, step_function, eager_step_function):
    """A step of one batch, run as a `DistributedStep`.

    Args:
        model: the model the step belongs to.
        kind: `"train"`, `"test"` or `"predict"`.
        step_function: a function of one batch, possibly compiled.
        eager_step_function: the same function, not compiled.

    Returns:
        A function of one batch.
    """

    def on_first(function):
        return lambda data: function(data[0])

    eager = on_first(eager_step_function)
    # `==`: a bound method is a new object at each access, equal to others.
    if step_function == eager_step_function:
        distributed = step.DistributedStep(model, kind, eager, eager)
    else:
        distributed = step.DistributedStep(
            model, kind, on_first(step_function), eager
        )
    return lambda batch: distributed([batch])


def process_data_adapter(adapter):
    """An adapter that reads only this process' share of the data.

    Args:
        adapter: the `DataAdapter` Keras made for the input.

    Returns:
        See `data_sources.process_data_adapter`.
    """
    # Lazy: data sources import the data adapters, which import this module.
    from keras.src.backend.torch.distributed.inputs import data_sources

    return data_sources.process_data_adapter(adapter)


def list_devices(device_type=None):
    """Return all the available devices based on the device type.

    In a multi-process job these are the global devices, one per process
    (`"gpu:i"` or `"cpu:i"`, `i` the global rank); otherwise the local ones.

    Args:
        device_type: `"cpu"` or `"gpu"`. Defaults to `"gpu"` if CUDA is
            available, otherwise `"cpu"`.

    Returns:
        List of device names that are available for distributed computation.
    """
    device_type = _standardize_device_type(device_type)
    if device_type == "gpu" and not torch.cuda.is_available():
        return []
    if runtime.world_size() > 1:
        return runtime.device_names(device_type)
    if device_type == "gpu":
        return [f"gpu:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu:0"]


def get_device_count(device_type=None):
    """Returns the number of devices `list_devices(device_type)` returns.

    Args:
        device_type: `"cpu"` or `"gpu"`; see `list_devices`.

    Returns:
        int: the number of devices of that type in the job.
    """
    return len(list_devices(device_type))


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """Initializes the default process group of a multi-process job.

    `None` arguments are read from torchrun's environment. Uses NCCL (and gloo
    for CPU tensors) on CUDA, else gloo; called again, it only checks that the
    arguments agree. Agrees on a global random seed if none was set.

    Args:
        job_addresses: comma separated `host:port` of all processes or of the
            coordinator alone; the first one is the coordinator.
        num_processes: int, the number of processes in the job.
        process_id: int, the rank of this process, in `[0, num_processes)`.
    """
    runtime.initialize_job(job_addresses, num_processes, process_id)
    call_agreement.start()


def num_processes():
    """Return the number of processes for the current distribution setting."""
    return runtime.world_size()


def process_id():
    """Return the current process ID for the distribution setting."""
    return runtime.rank()


def initialize_rng():
    """Makes every process use the same global random seed.

    Without `keras.utils.set_random_seed()`, process 0's seed is broadcast,
    so unseeded random ops (initializers, dropout) agree across processes.
    """
    runtime.agree_on_seed()


def set_global_distribution(distribution):
    """Records the distribution passed to `set_distribution`.

    The torch mesh is built and checked where first needed (reached alike by
    every process), so an unused distribution may be current in a job its
    mesh does not match. Every process must call this the first time a
    distribution is set: it joins the process group if needed and takes
    process 0's generator state; setting it again is no collective.

    Args:
        distribution: a `keras.distribution.Distribution`, or `None`.
    """
    if hasattr(distribution, "device_mesh"):
        runtime.check_torch_version()
        if runtime.world_size() > 1:
            if not torch.distributed.is_initialized():
                runtime.initialize_job()
            if distribution not in _rng_agreed:
                runtime.sync_torch_rng()
                _rng_agreed.add(distribution)
    runtime.set_process_distribution(distribution)
    layer_call.hold_replication(distribution)


def distribute_variable(value, layout):
    """Creates a variable's sharded value from process 0's full value.

    Args:
        value: the full (global) value, a `torch.Tensor`.
        layout: `TensorLayout` of the variable.

    Returns:
        A `DTensor` holding this process' shard.
    """
    return variables.distribute_variable(value, layout)


def distribute_tensor(tensor, layout):
    """Lays out a tensor, or every tensor in a nested structure.

    Differentiable. A plain tensor, array or `Variable` is the global value,
    the same on every process (as in JAX), cut locally. A dimension too short
    to give every process a part, or sharded over a mesh axis of size 1 (some
    torch versions refuse views merging it), is replicated instead.

    Args:
        tensor: a tensor, NumPy array, `Variable`, `DTensor` or nested
            structure of them.
        layout: `TensorLayout` to apply to each tensor, or `None` to return
            `tensor` as is.

    Returns:
        The same structure with every tensor laid out as `layout` says.
    """
    if layout is None:
        return tensor
    layout = layouts.as_torch_layout(layout)
    return tree.map_structure(
        functools.partial(_distribute_leaf, layout=layout), tensor
    )


def _distribute_leaf(x, layout):
    from keras.src.backend.common.variables import Variable

    if isinstance(x, Variable):
        x = x.value
    elif isinstance(x, np.ndarray):
        x = collectives.as_local_tensor(x)
    if not isinstance(x, torch.Tensor) or x.is_meta:
        return x
    layouts.check_rank(x, layout, "tensor")
    mesh = layout.device_mesh
    if not isinstance(x, DTensor):
        # `from_local` + `redistribute` (unlike torch's `distribute_tensor`)
        # keeps the autograd history; replicated to sharded is a local cut.
        x = layouts.replicate(x, mesh)
    placements = layouts.without_empty_shards(
        x.shape, mesh, layouts.drop_unit_shards(mesh, layout.placements)
    )
    return layouts.redistribute(x, mesh, placements)


def distribute_data_input(
    per_process_batch, layout, batch_dim_name, global_batch_size=None
):
    """Assembles the global batch from each process' part of it.

    The processes along the batch axis hold consecutive parts, sized as
    `torch.chunk` splits the batch; those along other axes hold the same.

    Args:
        per_process_batch: this process' part (arrays, possibly nested).
        layout: `TensorLayout` of the global batch.
        batch_dim_name: name of the mesh axis the batch is sharded on.
        global_batch_size: the global batch size, or `None` to exchange
            the part sizes.

    Returns:
        A `DTensor` (or structure of them) holding the global batch.
    """
    return data_input.distribute_data_input(
        per_process_batch, layout, batch_dim_name, global_batch_size
    )


def distribute_global_batch(data, distribution):
    """Distributes each global batch the trainer's steps receive.

    Each process keeps its rows of the global batch every source yields.

    Args:
        data: nested structure of arrays; the global batch.
        distribution: the `keras.distribution.Distribution` in effect.

    Returns:
        The same structure, each array replaced by a `DTensor`.
    """
    return data_input.distribute_global_batch(data, distribution)


def tf_dataset_adapter(dataset, class_weight=None, distribution=None):
    """Makes the data adapter of a `tf.data.Dataset` under `distribution`.

    A dataset whose batch size upstream cannot compute is read as global
    batches instead of refused (see `distributed.inputs.tf_data`).

    Args:
        dataset: a `tf.data.Dataset`.
        class_weight: optional dict of class ids to weights.
        distribution: the `Distribution` in effect, or `None`.

    Returns:
        A `TFDatasetAdapter`.
    """
    from keras.src.backend.torch.distributed.inputs import tf_data

    return tf_data.tf_dataset_adapter(dataset, class_weight, distribution)


def all_gather_variable(variable):
    """Returns the full value of a (possibly sharded) variable; a collective.

    Args:
        variable: a Keras `Variable` or a tensor.

    Returns:
        A plain `torch.Tensor` with the global value.
    """
    return variables.to_global_value(getattr(variable, "value", variable))


def distributed_checkpointer(directory, max_to_keep=None):
    """Returns the writer of `keras.callbacks.DistributedCheckpoint`.

    Each process writes its own shards with `torch.distributed.checkpoint`.

    Args:
        directory: the directory of the checkpoint steps.
        max_to_keep: how many of the latest steps to keep; `None`: all.

    Returns:
        A `Checkpointer` (`distributed.checkpoints.checkpoint`).
    """
    from keras.src.backend.torch.distributed.checkpoints import checkpoint

    return checkpoint.Checkpointer(directory, max_to_keep)


def is_distributed_checkpoint(path):
    """Whether `path` is a `DistributedCheckpoint` checkpoint (or steps)."""
    from keras.src.backend.torch.distributed.checkpoints import checkpoint

    return checkpoint.is_checkpoint(path)


def load_checkpoint_weights(model, path):
    """Loads a `DistributedCheckpoint` into `model`, in its layouts.

    Args:
        model: the Keras model, built.
        path: a checkpoint, or a directory of steps (the latest loads).
    """
    from keras.src.backend.torch.distributed.checkpoints import checkpoint

    checkpoint.load_weights(model, path)


def load_checkpoint_model(path, custom_objects=None, compile=True, **kwargs):
    """Rebuilds and loads the model a `DistributedCheckpoint` saved.

    Args:
        path: a checkpoint, or a directory of steps (the latest loads).
        custom_objects: as in `keras.saving.load_model`.
        compile: whether to compile the model as it was saved.
        **kwargs: `safe_mode`, as in `keras.saving.load_model`.

    Returns:
        The model, its variables and optimizer state restored.
    """
    from keras.src.backend.torch.distributed.checkpoints import checkpoint

    return checkpoint.load_model(path, custom_objects, compile, **kwargs)


def save_sharded_backup(model, weights_path):
    """Backs up `model` for `BackupAndRestore` as a sharded checkpoint.

    Args:
        model: the Keras model.
        weights_path: the `.weights.h5` path of the backup.

    Returns:
        `False` without a distribution (the caller saves `weights_path`).
    """
    from keras.src.backend.torch.distributed.checkpoints import checkpoint

    return checkpoint.save_backup(model, weights_path)


def find_sharded_backup(weights_path):
    """The sharded backup of `save_sharded_backup`, or `None` if none."""
    from keras.src.backend.torch.distributed.checkpoints import checkpoint

    return checkpoint.find_backup(weights_path)


def _to_backend_device(device_name):
    """Returns `(device_type, rank)` of a Keras `"gpu:i"`/`"cpu:i"` name."""
    return layouts.to_torch_device(device_name)


def _to_backend_mesh(device_mesh):
    """Convert the Keras `DeviceMesh` to a torch `DeviceMesh`."""
    return layouts.to_torch_mesh(device_mesh)


def _to_backend_layout(tensor_layout):
    """Convert a `TensorLayout` to a `TorchLayout`; `None` stays `None`."""
    if tensor_layout is None:
        return None
    return layouts.to_torch_layout(tensor_layout)


def _standardize_device_type(device_type):
    if device_type is None:
        return "gpu" if torch.cuda.is_available() else "cpu"
    device_type = device_type.lower()
    if device_type == "cuda":
        return "gpu"
    if device_type not in ("cpu", "gpu"):
        raise ValueError(
            "The torch backend supports device types 'cpu' and 'gpu'. "
            f"Received: device_type={device_type}"
        )
    return device_type
