"""The job a distribution runs in: its processes (one per device, in torch's
default group), the distribution in effect, and random state."""

import atexit
import contextlib
import datetime
import gc
import logging
import os
import time
import zlib

import torch
import torch.distributed as dist
from packaging.version import parse

from keras.src.backend.common import global_state
from keras.src.backend.torch.distributed.health import health

# The one import of DTensor's names, which the other modules take from here:
# Keras still imports on a torch without them (where a distribution refuses).
try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.experimental import implicit_replication

    DTENSOR_AVAILABLE = True
except ImportError:
    DTENSOR_AVAILABLE = False
    Partial = Replicate = Shard = implicit_replication = None

    class DTensor:
        """Stands in for torch's `DTensor`: no tensor is one."""


# The flat-buffer collectives (newer releases name them `*_single`, and
# warn on the old names).
all_gather_flat, reduce_scatter_flat = (
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor),
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor),
)
DEBUG_ENV = "KERAS_DISTRIBUTION_DEBUG"
LOG_ALL_PROCESSES_ENV = "KERAS_DISTRIBUTION_LOG_ALL_PROCESSES"
_PER_PROCESS_ENV = (  # Per-process; others choose collectives, so must agree.
    DEBUG_ENV,
    LOG_ALL_PROCESSES_ENV,
    health.STEP_TIMEOUT_ENV,
    health.START_TIMEOUT_ENV,
)
logger = logging.getLogger("keras.distribution")
log_debug = logger.debug
# The last `set_distribution`: Keras' global state is per thread, but hooks
# also run on threads that never set it (CUDA autograd's backward threads).
process_distribution = None
suspended_depth = 0


def current_distribution():
    """Returns the distribution in effect, also on threads that never set it
    (`None` inside `distribution_suspended`)."""
    if suspended_depth:
        return None
    distribution = global_state.get_global_attribute("distribution")
    return distribution if distribution is not None else process_distribution


def backend_core():
    """The torch backend's `core` module, directly or under `ops`."""
    import keras.src.backend.torch as torch_backend

    return getattr(torch_backend, "ops", torch_backend).core


@contextlib.contextmanager
def distribution_suspended():
    """Runs the block without a distribution, on plain tensors (local rows)."""
    global suspended_depth
    suspended_depth += 1
    try:
        yield
    finally:
        suspended_depth -= 1


@contextlib.contextmanager
def distribution_resumed():
    """Restores the distribution inside `distribution_suspended`."""
    global suspended_depth
    depth, suspended_depth = suspended_depth, 0
    try:
        yield
    finally:
        suspended_depth = depth


def world_size():
    """The number of processes of the job, without any collective."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def rank():
    """This process' rank in the job, without any collective."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def check_torch_version():
    """Raises if this torch cannot run a distribution."""
    if not DTENSOR_AVAILABLE or parse(torch.__version__).release < (2, 5):
        raise RuntimeError(
            "Keras distribution with the torch backend needs torch>=2.5 (with "
            f"`torch.distributed.tensor`). Found torch=={torch.__version__}. "
            "Upgrade torch, or run without a distribution."
        )


def initialize_job(job_addresses=None, num_processes=None, process_id=None):
    """Joins the job's default process group, creating it if needed."""
    check_torch_version()
    coordinator, num_processes, process_id = _resolve_job(
        job_addresses, num_processes, process_id
    )
    if not dist.is_initialized():
        _init_process_group(coordinator, num_processes, process_id)
    elif (num_processes, process_id) != (world_size(), rank()):
        raise ValueError(
            f"The process group is already initialized with world size "
            f"{dist.get_world_size()} and rank {dist.get_rank()}, which "
            f"contradicts num_processes={num_processes}, "
            f"process_id={process_id}."
        )
    agree_on_environment()
    agree_on_seed()


def agree_on_environment():
    """Raises on every process unless all set alike the `KERAS_DISTRIBUTION_*`
    variables choosing collectives (else one alone in a collective hangs)."""
    if world_size() == 1:
        return
    choices = sorted(
        (k, v)
        for k, v in os.environ.items()
        if k.startswith("KERAS_DISTRIBUTION_") and k not in _PER_PROCESS_ENV
    )
    digest = torch.tensor(
        [zlib.crc32(repr(choices).encode())], device=comm_device()
    )
    digests = [torch.empty_like(digest) for _ in range(world_size())]
    dist.all_gather(digests, digest)
    if all(torch.equal(d, digest) for d in digests):
        return
    every = [None] * world_size()
    dist.all_gather_object(every, dict(choices))
    names = sorted({name for own in every for name in own})
    values = {n: [own.get(n, "<unset>") for own in every] for n in names}
    values = {n: v for n, v in values.items() if len(set(v)) > 1}
    raise ValueError(
        "Every process must set the same `KERAS_DISTRIBUTION_*` variables that "
        f"choose collectives. Received, per process (0 to {world_size() - 1}): "
        f"{values}. Set them alike in the environment of every process."
    )


def agree_on_seed():
    """Gives every process process 0's seed if any set none, so unseeded random
    ops (initializers, dropout) agree; seeds set on all processes are kept."""
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    if world_size() == 1:
        return
    own = rng_utils.get_random_seed()
    unseeded = torch.tensor([int(own is None)], device=comm_device())
    dist.all_reduce(unseeded, op=dist.ReduceOp.MAX)
    if not unseeded.item():
        return
    seed = seed_generator.make_default_seed() if own is None else own
    seed = torch.tensor([seed], dtype=torch.int64, device=comm_device())
    dist.broadcast(seed, src=0)
    if own != int(seed.item()):
        rng_utils.set_random_seed(int(seed.item()))


def sync_torch_rng():
    """Gives every process process 0's torch RNG state (a collective), so
    that unseeded dropout draws the same whole-tensor noise everywhere."""
    generators = [(torch.get_rng_state, torch.set_rng_state)]
    if torch.cuda.is_available():
        generators.append((torch.cuda.get_rng_state, torch.cuda.set_rng_state))
    for get_state, set_state in generators:
        state = get_state().to(comm_device())
        dist.broadcast(state, src=0)
        set_state(state.cpu())


def comm_device():
    """The device of tensors handed to collectives on the default group."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_job(job_addresses, num_processes, process_id):
    """`(coordinator, num_processes, process_id)`: `initialize`'s arguments
    reconciled with torchrun's environment (no coordinator: `MASTER_ADDR`)."""
    env_world, env_rank = os.environ.get("WORLD_SIZE"), os.environ.get("RANK")
    for name, given, env in (
        ("num_processes", num_processes, env_world),
        ("process_id", process_id, env_rank),
    ):
        if given is not None and env is not None and int(given) != int(env):
            raise ValueError(
                f"`{name}`={given} contradicts the launcher's environment "
                f"(WORLD_SIZE={env_world}, RANK={env_rank}). Leave it unset "
                "under torchrun, or pass the same value."
            )
    coordinator = None
    if job_addresses:
        addresses = [a.strip() for a in job_addresses.split(",") if a.strip()]
        count = len(addresses)
        if num_processes is not None and 1 < count != int(num_processes):
            raise ValueError(
                f"The provided job_addresses {addresses} has {count} jobs, "
                f"but num_processes is {num_processes}"
            )
        if ":" not in addresses[0]:
            raise ValueError(
                "job_addresses must be given as 'host:port'. Received: "
                f"job_addresses='{job_addresses}'"
            )
        coordinator = addresses[0]
    if num_processes is None:
        num_processes = 1 if env_world is None else env_world
    if process_id is None:
        process_id = 0 if env_rank is None else env_rank
    num_processes, process_id = int(num_processes), int(process_id)
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            "process_id must be in [0, num_processes). Received: "
            f"num_processes={num_processes}, process_id={process_id}"
        )
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if num_processes > 1 and coordinator is None and missing:
        raise ValueError(
            f"A job of {num_processes} processes needs the coordinator's "
            "address: pass job_addresses='host:port' (or set "
            "KERAS_DISTRIBUTION_JOB_ADDRESSES), or launch with torchrun. "
            f"Missing environment variables: {missing}"
        )
    return coordinator, num_processes, process_id


def _init_process_group(coordinator, num_processes, process_id):
    """Creates the job's default process group (NCCL and gloo on CUDA)."""
    timeout = datetime.timedelta(seconds=health.start_timeout())
    how = dict(backend="gloo", world_size=num_processes, rank=process_id)
    if torch.cuda.is_available():
        torch.cuda.set_device(_local_gpu(process_id))
        how["backend"] = "cpu:gloo,cuda:nccl"
    if num_processes == 1 and coordinator is None:
        how["store"] = dist.HashStore()
    elif coordinator is not None:
        how["init_method"] = f"tcp://{coordinator}"
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's store, keyed by attempt: restarts keep it, and `env://`
        # would find the last attempt's dead processes.
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        how["store"] = dist.PrefixStore(f"keras/attempt_{attempt}", store)
    else:
        how["init_method"] = "env://"
    dist.init_process_group(timeout=timeout, **how)
    atexit.register(_destroy_process_group)  # Exit-time teardown can abort.
    health.install(coordinator)
    message = "process group: backend %(backend)s, world size %(world_size)d"
    log_debug(message, how)


def _local_gpu(process_id):
    """This process' GPU index; refuses more processes on the node than GPUs
    (NCCL fails at the first collective when two processes share a GPU)."""
    num_gpus = torch.cuda.device_count()
    if "LOCAL_RANK" not in os.environ:
        return process_id % num_gpus
    local_rank = int(os.environ["LOCAL_RANK"])
    on_node = max(int(os.environ.get("LOCAL_WORLD_SIZE", 0)), local_rank + 1)
    if on_node > num_gpus:
        raise ValueError(
            f"This node runs {on_node} processes but sees {num_gpus} "
            "GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}), and "
            "NCCL needs one GPU per process. Launch at most one process per "
            f"GPU (torchrun --nproc_per_node={num_gpus}), or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=) to run every process on CPU with gloo."
        )
    return local_rank


def _destroy_process_group():
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # Free groups held by reference cycles before shutdown.
        # Gloo threads of groups a live mesh holds abort the process if they
        # drop a tensor at shutdown (pytorch#190489): let them finish first.
        time.sleep(0.05)


if os.environ.get(DEBUG_ENV, "0") not in ("", "0", "false", "False"):

    def _with_rank(record):
        """Adds the process rank (never by a collective) to a log record."""
        record.rank = rank()
        return True

    _handler = logging.StreamHandler()
    _handler.addFilter(_with_rank)
    _handler.setFormatter(
        logging.Formatter("[rank %(rank)s] %(name)s: %(message)s")
    )
    logger.addHandler(_handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
GATHERED_ALL_TO_ALL_NOTICE = (
    "CPU process group does not support alltoall yet, falling back with "
    "allgather + chunk!"
)


class _GatheredAllToAllFilter(logging.Filter):
    """Drops DTensor's harmless notice that CPU meshes gather for all-to-all."""

    def filter(self, record):
        return record.msg != GATHERED_ALL_TO_ALL_NOTICE


logging.getLogger("torch.distributed.tensor._collective_utils").addFilter(
    _GatheredAllToAllFilter()
)
