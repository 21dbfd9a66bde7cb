"""The torch backend's distribution interface, which generic Keras code calls:
a Keras `DeviceMesh` is a torch one with one device per process, a layout
DTensor placements, and a plain tensor a global value (as an array in JAX)."""

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
from keras.src.backend.torch.distributed.data_parallel import batch_coupling
from keras.src.backend.torch.distributed.data_parallel import coupled_layers
from keras.src.backend.torch.distributed.data_parallel import local_loss
from keras.src.backend.torch.distributed.data_parallel import local_rows
from keras.src.backend.torch.distributed.fsdp import fsdp
from keras.src.backend.torch.distributed.fsdp import fsdp_schedule
from keras.src.backend.torch.distributed.health import call_agreement
from keras.src.backend.torch.distributed.inputs import data_input
from keras.src.backend.torch.distributed.tensor_parallel import pairing_check
from keras.src.backend.torch.distributed.training import layer_call
from keras.src.backend.torch.distributed.training import step

_rng_agreed = weakref.WeakSet()  # Distributions with torch's RNG state agreed.
# The techniques' parts of each layer call and step.
layer_call.techniques = layer_call.Techniques(
    # Data parallelism: per-sample calls on each process' rows, layers that
    # couple samples through DTensor.
    rows_call=local_rows.call,
    suspended_call=coupled_layers.suspended_call,
    record=batch_coupling.record,
    # FSDP: weights sharded over the batch axis gathered for each call.
    weights=fsdp.gathered_weights,
    # Tensor parallelism: `AutoModelParallel`'s pairings checked when built.
    trace=pairing_check.active_trace,
    built=pairing_check.check_layer,
)
step.techniques = step.Techniques(
    # Data parallelism: the loss on the rows (a sharded class axis gathered).
    rows=local_rows.StepRows,
    predictions=local_loss.gathered_predictions,
    # FSDP: gathers ahead in the order of the step before; not compiled.
    context=fsdp_schedule.step_schedule,
    eager_reason=fsdp.eager_reason,
)

# The interface, from the modules doing the work (optional capabilities first).
async_callbacks_supported = process_io.async_callbacks_supported
is_logging_process = process_io.is_logging_process
run_on_one_process = process_io.run_on_one_process
save_from_one_process = process_io.save_from_one_process
mesh_info = summary.mesh_info
sharding_summary = summary.sharding_summary
current_distribution = runtime.current_distribution
num_processes = runtime.world_size
process_id = runtime.rank
initialize_rng = runtime.agree_on_seed
distribute_variable = variables.distribute_variable
distribute_global_batch = data_input.distribute_global_batch
distribute_data_input = data_input.distribute_data_input
_to_backend_device = layouts.to_torch_device
_to_backend_mesh = layouts.to_torch_mesh
all_reduce = collectives.all_reduce
all_gather = collectives.all_gather
DistributedStep = step.DistributedStep
loss_predictions = step.loss_predictions
local_loss = step.local_loss
metric_predictions = step.metric_predictions
reduce_gradients = step.reduce_gradients
local_metric_state = step.local_metric_state
local_metric_reads = step.local_metric_reads


def check_same_num_batches(num_batches, data_adapter=None):
    """Agrees on the start of iterating over a dataset; raises on every
    process if their numbers of batches differ. Where each process reads its
    own data, parts of sizes every process agrees on here are assembled into
    global batches without a collective at each step.

    Args:
        num_batches: the number of batches of the epoch, or `None`.
        data_adapter: the data's adapter.
    """
    # Lazy: data sources import the data adapters, which import this module.
    from keras.src.backend.torch.distributed.inputs import equal_parts

    distribution, sizes = runtime.current_distribution(), None
    if distribution is not None and not distribution.auto_shard_dataset:
        sizes = equal_parts.batch_sizes(data_adapter)
    if call_agreement.check_same_num_batches(num_batches, sizes):
        equal_parts.agree(data_adapter)


def batch_step(model, kind, step_function, eager_step_function):
    """A step of one batch, run as a `DistributedStep`.

    Args:
        model: the model the step belongs to.
        kind: `"train"`, `"test"` or `"predict"`.
        step_function: a function of one batch, possibly compiled.
        eager_step_function: the same function, not compiled.
    """
    eager = _on_first(eager_step_function)
    same = step_function == eager_step_function  # Bound methods: new but equal.
    compiled = eager if same else _on_first(step_function)
    distributed = step.DistributedStep(model, kind, compiled, eager)
    return lambda batch: distributed([batch])


def _on_first(function):
    """`function` of one batch as a function of `[batch]`."""
    return lambda data: function(data[0])


def process_data_adapter(adapter):
    """An adapter of `adapter` reading only this process' share of the data."""
    # Lazy: data sources import the data adapters, which import this module.
    from keras.src.backend.torch.distributed.inputs import data_sources

    return data_sources.process_data_adapter(adapter)


def list_devices(device_type=None):
    """Returns the available devices: in a multi-process job one per process
    (`"gpu:i"` or `"cpu:i"`, `i` the global rank), else local ones.

    Args:
        device_type: `"gpu"` (default with CUDA) or `"cpu"` (else the default).
    """
    if device_type is None:
        device_type = "gpu" if torch.cuda.is_available() else "cpu"
    device_type = device_type.lower()
    device_type = "gpu" if device_type == "cuda" else device_type
    if device_type not in ("cpu", "gpu"):
        raise ValueError(
            "The torch backend supports device types 'cpu' and 'gpu'. "
            f"Received: device_type={device_type}"
        )
    if device_type == "gpu" and not torch.cuda.is_available():
        return []
    count = runtime.world_size()
    if count < 2:
        count = torch.cuda.device_count() if device_type == "gpu" else 1
    return [f"{device_type}:{i}" for i in range(count)]


def get_device_count(device_type=None):
    """Returns the number of devices `list_devices(device_type)` returns."""
    return len(list_devices(device_type))


def initialize(job_addresses=None, num_processes=None, process_id=None):
    """Initializes a multi-process job's default process group; `None` arguments
    come from torchrun's environment. NCCL (and gloo for CPU tensors) on CUDA,
    else gloo; called again, only checks that the arguments agree. Agrees on a
    global random seed if none was set.

    Args:
        job_addresses: comma separated `host:port`s, coordinator first or alone.
        num_processes: int, the number of processes in the job.
        process_id: int, the rank of this process, in `[0, num_processes)`.
    """
    runtime.initialize_job(job_addresses, num_processes, process_id)
    call_agreement.start()


def set_global_distribution(distribution):
    """Records `set_distribution`'s distribution (its mesh is built where first
    used); every process joins the job and takes process 0's RNG state once."""
    if hasattr(distribution, "device_mesh"):
        runtime.check_torch_version()
        if runtime.world_size() > 1:
            if not torch.distributed.is_initialized():
                runtime.initialize_job()
            if distribution not in _rng_agreed:
                runtime.sync_torch_rng()
                _rng_agreed.add(distribution)
    runtime.process_distribution = distribution
    layer_call.hold_replication(distribution)


def distribute_tensor(tensor, layout):
    """Lays out a tensor, or each tensor of a nest, differentiably. A plain
    tensor, array or `Variable` is the global value (as in JAX), cut locally. A
    dimension too short to give every process a part, or sharded over a size-1
    mesh axis (some torch versions refuse views merging it), is replicated.

    Args:
        tensor: a tensor, NumPy array, `Variable`, `DTensor` or a nest of them.
        layout: `TensorLayout` for each tensor; `None` returns `tensor` as is.
    """
    if layout is None:
        return tensor
    layout = layouts.as_torch_layout(layout)
    return tree.map_structure(lambda x: _distribute_leaf(x, layout), tensor)


def _distribute_leaf(x, layout):
    """One leaf of `distribute_tensor`."""
    from keras.src.backend.common.variables import Variable

    if isinstance(x, Variable):
        x = x.value
    elif isinstance(x, np.ndarray):
        x = collectives.as_local_tensor(x)
    if not isinstance(x, torch.Tensor) or x.is_meta:
        return x
    layouts.check_rank(x, layout, "tensor")
    mesh = layout.device_mesh
    # `from_local` + `redistribute` (unlike torch's `distribute_tensor`) keeps
    # the autograd history; replicated to sharded is a local cut.
    x = layouts.replicate(x, mesh)
    placements = layouts.without_empty_shards(
        x.shape, mesh, layouts.drop_unit_shards(mesh, layout.placements)
    )
    return layouts.redistribute(x, mesh, placements)


def tf_dataset_adapter(dataset, class_weight=None, distribution=None):
    """The `TFDatasetAdapter` of a `tf.data.Dataset` under `distribution`; one
    whose batch size upstream cannot compute is read as global batches."""
    from keras.src.backend.torch.distributed.inputs import tf_data

    return tf_data.tf_dataset_adapter(dataset, class_weight, distribution)


def all_gather_variable(variable):
    """The global value of a variable or tensor (a collective if sharded)."""
    return variables.to_global_value(getattr(variable, "value", variable))


def distributed_checkpointer(directory, max_to_keep=None):
    """`DistributedCheckpoint`'s `Checkpointer`, of steps under `directory`."""
    return _checkpoint().Checkpointer(directory, max_to_keep)


def is_distributed_checkpoint(path):
    """Whether `path` is a `DistributedCheckpoint` checkpoint (or steps)."""
    return _checkpoint().is_checkpoint(path)


def load_checkpoint_weights(model, path):
    """Loads a `DistributedCheckpoint` or latest step into `model`'s layouts."""
    _checkpoint().load_weights(model, path)


def load_checkpoint_model(path, custom_objects=None, compile=True, **kwargs):
    """Rebuilds the model a `DistributedCheckpoint` saved, as `load_model`."""
    return _checkpoint().load_model(path, custom_objects, compile, **kwargs)


def save_sharded_backup(model, weights_path):
    """Backs up `model` for `BackupAndRestore` as a sharded checkpoint;
    `False` without a distribution (the caller saves `weights_path`)."""
    return _checkpoint().save_backup(model, weights_path)


def find_sharded_backup(weights_path):
    """The backup `save_sharded_backup` wrote, or `None`."""
    return _checkpoint().find_backup(weights_path)


def _checkpoint():
    """The checkpoint module (DCP), imported when first needed."""
    from keras.src.backend.torch.distributed.checkpoints import checkpoint

    return checkpoint


def _to_backend_layout(tensor_layout):
    """Convert a `TensorLayout` to a `TorchLayout`; `None` stays `None`."""
    return tensor_layout and layouts.to_torch_layout(tensor_layout)
