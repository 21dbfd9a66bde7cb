"""Printing and saving from process 0 alone in a multi-process job."""

import os
import shutil
import tempfile

import torch.distributed as dist

from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.health import call_agreement

LOG_ALL_PROCESSES_ENV = "KERAS_DISTRIBUTION_LOG_ALL_PROCESSES"


def is_logging_process():
    """Whether this process prints progress bars and callback messages:
    process 0 only, unless `KERAS_DISTRIBUTION_LOG_ALL_PROCESSES=1`."""
    if os.environ.get(LOG_ALL_PROCESSES_ENV) == "1":
        return True
    return runtime.rank() == 0


def async_callbacks_supported():
    """Whether callbacks may run on another thread than the steps: not under
    a distribution (converting sharded logs to numpy is a collective)."""
    return runtime.current_distribution() is None


def save_from_one_process(save_function, model, filepath, *args, **kwargs):
    """Runs `save_function(model, filepath, *args, **kwargs)` on every process
    (gathering sharded variables is a collective); process 0's temporary file
    is renamed over `filepath` (never seen partial). Returns once in place."""
    if runtime.world_size() == 1 or not _is_local_file(filepath):
        return save_function(model, filepath, *args, **kwargs)
    filepath = os.fspath(filepath)
    directory, name = os.path.split(os.path.abspath(filepath))
    with call_agreement.collective_call("saving a model to one file"):
        if runtime.rank() == 0:
            scratch = tempfile.mkdtemp(prefix=f".{name}.", dir=directory)
        else:
            scratch = tempfile.mkdtemp(prefix="keras-save-")
        try:
            temporary = os.path.join(scratch, name)
            save_function(model, temporary, *args, **kwargs)
            if runtime.rank() == 0:
                os.replace(temporary, filepath)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        dist.barrier()


def run_on_one_process(function):
    """Runs `function()` on process 0 only, then waits for it everywhere;
    returns its result on process 0, `None` on the others."""
    if runtime.world_size() == 1:
        return function()
    result = function() if runtime.rank() == 0 else None
    dist.barrier()
    return result


def _is_local_file(filepath):
    try:
        path = os.fspath(filepath)
    except TypeError:  # A file object.
        return False
    return "://" not in str(path)
