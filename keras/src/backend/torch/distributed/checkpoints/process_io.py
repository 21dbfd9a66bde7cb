"""Printing and saving from process 0 alone in a multi-process job."""

import os
import shutil
import tempfile

import torch.distributed as dist

from keras.src.backend.torch.distributed.core import collectives
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.health import call_agreement


def is_logging_process():
    """Whether this process prints progress bars and callback messages:
    process 0 only, unless `KERAS_DISTRIBUTION_LOG_ALL_PROCESSES=1`."""
    return (
        os.environ.get(runtime.LOG_ALL_PROCESSES_ENV) == "1"
        or runtime.rank() == 0
    )


def async_callbacks_supported():
    """Whether callbacks may run on another thread than the steps: not under
    a distribution (converting sharded logs to numpy is a collective)."""
    return runtime.current_distribution() is None


def save_from_one_process(save_function, model, filepath, *args, **kwargs):
    """Runs `save_function(model, filepath, *args, **kwargs)` on every process
    (a collective), renaming process 0's temporary file over `filepath`."""
    try:
        local = "://" not in str(os.fspath(filepath))
    except TypeError:  # A file object.
        local = False
    if runtime.world_size() == 1 or not local:
        return save_function(model, filepath, *args, **kwargs)
    directory, name = os.path.split(os.path.abspath(filepath))
    with call_agreement.collective_call("saving a model to one file"):
        # Before the save's gathers: a missing directory raises everywhere.
        scratch = run_on_one_process(
            lambda: tempfile.mkdtemp(prefix=f".{name}.", dir=directory)
        )
        if runtime.rank() != 0:
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
    return raised_together(function if runtime.rank() == 0 else lambda: None)


def raised_together(function):
    """`function()`, then a wait for every process: an error of any process is
    raised on all, which would otherwise hang in their next collective."""
    result, error = None, None
    try:
        result = function()
    except Exception as e:  # Raised below, here and on every process.
        error = e
    failed = runtime.world_size() > 1 and collectives.any_process(
        error is not None, None
    )
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            "Another process failed writing for the job (its log has the "
            "error); this process stops with it."
        )
    return result
