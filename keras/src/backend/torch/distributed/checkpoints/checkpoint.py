"""Sharded checkpoints: DCP files each process writes and loads its shards of
(under any mesh or world size) and `keras_checkpoint.json` (variables, config),
written to `.partial-<step>/` and renamed once complete."""

import concurrent.futures
import contextlib
import datetime
import functools
import json
import os
import shutil
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from keras.src.backend.torch.distributed.checkpoints import process_io
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.health import health

INFO_FILE = "keras_checkpoint.json"
METADATA_FILE = ".metadata"
FORMAT = "keras.DistributedCheckpoint"
PARTIAL_PREFIX = ".partial-"


class Checkpointer:
    """A run's checkpoints, `directory/<step>/`, the `max_to_keep` latest."""

    def __init__(self, directory, max_to_keep=None):
        if max_to_keep is not None and (
            not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(
                "`max_to_keep` must be a positive integer or None. "
                f"Received: max_to_keep={max_to_keep}"
            )
        self.directory = os.fspath(directory)
        if "://" in self.directory:
            raise ValueError(
                "Distributed checkpoints are written to a local or mounted "
                "file system every process sees. Received: "
                f"directory={self.directory}"
            )
        self.max_to_keep, self._pending = max_to_keep, None

    def save(self, model, step, weights_only=False, background=False):
        """Saves `model` as step `step`; every process must call it."""
        self.wait()
        path = os.path.join(self.directory, str(int(step)))
        full = not weights_only  # The optimizer's state and the config too.
        self._pending = save_checkpoint(
            model, path, full, full, background, self._prune
        )

    def wait(self):
        """Waits for the background save in progress, if any, to finish."""
        pending, self._pending = self._pending, None
        if pending is not None:
            # Process 0's future alone also puts the checkpoint in place.
            process_io.raised_together(pending.result)

    def _prune(self):
        if self.max_to_keep is not None:
            for step in complete_steps(self.directory)[: -self.max_to_keep]:
                path = os.path.join(self.directory, str(step))
                shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    model,
    path,
    include_optimizer=True,
    include_config=True,
    background=False,
    on_complete=None,
):
    """Writes `model` to `path` atomically (replacing it); all processes call. A
    `background` save returns once staged: a future done (or raising) once the
    checkpoint is in place on process 0, where `on_complete` runs."""
    from keras.src.saving import saving_lib

    no_dist, group = not _distributed(), None
    if background and not no_dist:
        group = _background_group(dist.group.WORLD)
    path = os.path.abspath(os.fspath(path))
    partial = _sibling(path, PARTIAL_PREFIX)
    groups = {"model": _model_variables(model), "optimizer": []}
    optimizer = getattr(model, "optimizer", None)
    if include_optimizer and optimizer is not None and optimizer.built:
        groups["optimizer"] = list(optimizer.variables)

    def prepare():
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        info = {"format": FORMAT}
        for name, variables in groups.items():
            info[name] = [
                {"path": v.path, "shape": list(v.shape), "dtype": str(v.dtype)}
                for v in variables
            ]
        info["optimizer"], info["config"] = info["optimizer"] or None, None
        if include_config:
            info["config"], _ = saving_lib._serialize_model_as_json(model)
        with open(os.path.join(partial, INFO_FILE), "w") as f:
            json.dump(info, f)

    def finish():
        if runtime.rank() == 0:
            # os.replace cannot replace a non-empty directory: old aside.
            replaced = _sibling(path, ".replaced-")
            if os.path.exists(path):
                shutil.rmtree(replaced, ignore_errors=True)
                os.replace(path, replaced)
            os.replace(partial, path)
            shutil.rmtree(replaced, ignore_errors=True)
            if on_complete is not None:
                on_complete()

    process_io.run_on_one_process(prepare)
    # DCP saves and loads shards in place: no process holds a whole variable.
    state = {
        f"{name}/{i}": v.value.detach()
        for name, variables in groups.items()
        for i, v in enumerate(variables)
    }
    with _single_process_quietly():
        if not background:
            dcp.save(state, checkpoint_id=partial, no_dist=no_dist)
            return process_io.run_on_one_process(finish)
        upload = dcp.async_save(
            state, checkpoint_id=partial, process_group=group, no_dist=no_dist
        )
    done = concurrent.futures.Future()

    def callback(future):
        try:
            future.result()
            finish()
            done.set_result(None)
        except BaseException as e:  # Re-raised by `done.result()`.
            done.set_exception(e)

    upload.add_done_callback(callback)
    return done


def is_checkpoint(path):
    """Whether `path` is a checkpoint or a directory of checkpoint steps."""
    try:
        path = os.fspath(path)
    except TypeError:
        return False
    if "://" in path or not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, INFO_FILE)):
        return True
    partial = any(n.startswith(PARTIAL_PREFIX) for n in os.listdir(path))
    return partial or bool(complete_steps(path))


def complete_steps(directory):
    """The steps with a complete checkpoint under `directory`, ascending."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        int(n)
        for n in os.listdir(directory)
        if n.isdigit() and _is_complete(os.path.join(directory, n))
    )


def resolve(path):
    """The checkpoint `path` names (itself or latest complete step) as process 0
    finds it, for all: listings may lag saves; mixed steps load silently."""
    path, found, error = os.fspath(path), None, None
    if os.path.isfile(os.path.join(path, INFO_FILE)):
        if _is_complete(path):
            found = path
        else:
            error = (
                f"The checkpoint at {path} is incomplete: its save was "
                "interrupted. Load another step."
            )
    elif steps := complete_steps(path):
        found = os.path.join(path, str(steps[-1]))
    else:
        error = (
            f"No complete checkpoint in {path}: every save there was "
            "interrupted before it finished."
        )
    if _distributed() and dist.get_world_size() > 1:
        shared = [found, error]
        dist.broadcast_object_list(shared, src=0)
        found, error = shared
    if error is not None:
        raise ValueError(error)
    return found


def load_weights(model, path):
    """Loads checkpoint (or latest step) `path` into built `model`'s variables
    (the optimizer's too) in their current layouts; every process calls it."""
    path = resolve(path)
    info, groups = read_info(path), {"model": _model_variables(model)}
    optimizer = getattr(model, "optimizer", None)
    if info.get("optimizer") is not None and optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        groups["optimizer"] = list(optimizer.variables)
    state = {}
    # Checked on every process before the collective load: all raise alike.
    for group, variables in groups.items():
        saved = info[group]
        if len(saved) != len(variables):
            raise ValueError(
                f"The checkpoint at {path} has {len(saved)} {group} "
                f"variables; the model has {len(variables)}. Load it into a "
                "model of the same architecture (and the same optimizer)."
            )
        for i, (entry, variable) in enumerate(zip(saved, variables)):
            if tuple(entry["shape"]) != tuple(variable.shape):
                raise ValueError(
                    f"The checkpoint's variable '{entry['path']}' has shape "
                    f"{tuple(entry['shape'])}; the model's variable "
                    f"'{variable.path}' has shape {tuple(variable.shape)}. "
                    "Load it into a model of the same architecture."
                )
            state[f"{group}/{i}"] = variable.value.detach()
    with _single_process_quietly():
        dcp.load(state, checkpoint_id=path, no_dist=not _distributed())


def load_model(path, custom_objects=None, compile=True, safe_mode=True):
    """The model checkpoint (or latest step) `path` was saved from, loaded."""
    from keras.src.saving import saving_lib

    path = resolve(path)
    config = read_info(path).get("config")
    if config is None:
        raise ValueError(
            f"The checkpoint at {path} has no model config: it was saved "
            "with `save_weights_only=True`. Build the model and call "
            "`model.load_weights(path)` instead."
        )
    model = saving_lib._model_from_config(
        config, custom_objects, compile, safe_mode
    )
    load_weights(model, path)
    return model


def read_info(path):
    """The contents of a checkpoint's `keras_checkpoint.json`."""
    with open(os.path.join(path, INFO_FILE)) as f:
        info = json.load(f)
    if info.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a checkpoint of `DistributedCheckpoint`: its "
            f"{INFO_FILE} has format {info.get('format')!r}."
        )
    return info


def save_backup(model, weights_path):
    """Backs up `model` for `BackupAndRestore` as a sharded checkpoint named
    after `weights_path`; `False` (not saved) without a distribution."""
    if runtime.current_distribution() is None:
        return False
    save_checkpoint(model, _backup_path(weights_path), include_config=False)
    return True


def find_backup(weights_path):
    """The complete sharded backup of a `.weights.h5` path, or `None`."""
    path = _backup_path(weights_path)
    return path if _is_complete(path) else None


def _backup_path(weights_path):
    return os.fspath(weights_path).removesuffix(".weights.h5") + ".checkpoint"


def _model_variables(model):
    return list(model.trainable_variables) + list(model.non_trainable_variables)


def _is_complete(path):
    names = (METADATA_FILE, INFO_FILE)
    return all(os.path.isfile(os.path.join(path, n)) for n in names)


def _sibling(path, prefix):
    directory, name = os.path.split(path)
    return os.path.join(directory, prefix + name)


def _distributed():
    return dist.is_available() and dist.is_initialized()


@functools.lru_cache(maxsize=1)
def _background_group(world):
    """The process group of background saves, whose collectives would mix with
    the step's in `world`; bound by the start timeout, as saves may run long."""
    timeout = datetime.timedelta(seconds=health.start_timeout())
    return dist.new_group(backend="gloo", timeout=timeout)


@contextlib.contextmanager
def _single_process_quietly():
    # Without a process group DCP warns it assumes one process: that's meant.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield
