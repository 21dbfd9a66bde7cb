"""Where the benchmark runs: process group, device, attention kernel and
the machine description printed with the results."""

import contextlib
import os
import platform

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend
from torch.nn.attention import sdpa_kernel

import keras


def setup(args):
    """Process group, threads and device; returns the torch device."""
    torch.set_num_threads(args.threads)
    # Joins the torchrun job (gloo on CPU, nccl on GPU).
    keras.distribution.initialize()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def machine_info(args, device):
    """What the numbers were measured on."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            names = [
                line.split(":", 1)[1].strip()
                for line in f
                if line.startswith("model name")
            ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "device": str(device.type),
        "load_average": _load_average(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _load_average():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def sdpa_context(args, device):
    """The attention-kernel context both sides run their steps in."""
    if args.sdpa == "math" or device.type == "cpu":
        return lambda: sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
