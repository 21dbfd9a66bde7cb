"""`keras.callbacks.DistributedCheckpoint`: sharded checkpoints on DCP.

Saved on a 2x2 mesh (4 processes), a checkpoint loads into a (1, 2) mesh,
`DataParallel` and one process with no distribution; training resumed from
a checkpoint equals training without interruption; a background save
writes what a synchronous one writes; an interrupted save (an error on one
process, or a process killed) leaves the previous step the latest;
`BackupAndRestore` backs up through DCP under a distribution.

References never share the code under test: weights are compared with the
model's own variables read whole (`convert_to_numpy`) at the time of the
save, and resumed training with the same training run uninterrupted.
"""

import multiprocessing
import os

import numpy as np
import pytest

from tests.distributions import use_data_parallel
from tests.distributions import use_model_parallel
from tests.harness import run_on_ranks

# Sharded on both mesh axes, on one, or replicated.
RULES_2X2 = {
    ".*up/kernel": ("batch", "model"),
    ".*up/bias": ("model",),
    ".*down/kernel": ("model", None),
}
# Other layouts on another mesh: what was sharded is replicated and back.
RULES_1X2 = {".*up/kernel": ("model", None), ".*down/bias": ("model",)}
EPOCHS = 3
TIMEOUT = 240


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    return x, y


def _model():
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="up"),
            keras.layers.Dense(4, name="down"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def _state(model):
    """Every model and optimizer variable, read whole, by position."""
    from keras import ops

    variables = model.weights + model.optimizer.variables
    return [ops.convert_to_numpy(v) for v in variables]


def _assert_states_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)


def _on_2_ranks(body, tmp_path):
    """`body(rank, world_size, directory)` on 2 ranks, the checkpoints in
    `tmp_path`."""
    return run_on_ranks(
        body, world_size=2, args=(str(tmp_path / "ckpt"),), timeout=TIMEOUT
    )


def _fit(model, epochs, callbacks=(), initial_epoch=0):
    x, y = _data()
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=epochs,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )
    return history.history["loss"]


def _save_on_2x2(rank, world_size, directory):
    from torch.distributed.checkpoint import FileSystemReader

    import keras

    use_model_parallel(layout_rules=RULES_2X2, mesh_shape=(2, 2))
    model = _model()
    states = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: states.append(_state(model))
    )
    callback = keras.callbacks.DistributedCheckpoint(
        directory, max_to_keep=2, save_on_background=False
    )
    _fit(model, EPOCHS, [callback, record])
    # Where DCP stored each chunk of the kernel sharded on both axes.
    step = os.path.join(directory, str(EPOCHS - 1))
    metadata = FileSystemReader(step).read_metadata()
    kernel = [
        i for i, v in enumerate(model.weights) if v.path.endswith("up/kernel")
    ]
    local = model.weights[kernel[0]].value.to_local()
    chunks = {
        tuple(index.offset): info.relative_path
        for index, info in metadata.storage_data.items()
        if index.fqn == f"model/{kernel[0]}"
    }
    files = {
        index.fqn: info.relative_path
        for index, info in metadata.storage_data.items()
    }
    # Bytes in the files against the bytes the metadata points to: a value
    # written by two processes would be in the files twice.
    stored = sum(info.length for info in metadata.storage_data.values())
    written = sum(
        os.path.getsize(os.path.join(step, name))
        for name in os.listdir(step)
        if name.endswith(".distcp")
    )
    return {
        "states": states,
        "steps": sorted(os.listdir(directory)),
        "kernel_chunks": chunks,
        "local_kernel_shape": tuple(local.shape),
        "files": files,
        "stored_bytes": stored,
        "written_bytes": written,
    }


def _load_body(rank, world_size, directory, setting):
    import keras

    if setting == "dp":
        use_data_parallel()
    else:
        use_model_parallel(layout_rules=RULES_1X2, mesh_shape=(1, 2))
    model = _model()
    model.load_weights(directory)
    weights_state = _state(model)
    loaded = keras.saving.load_model(os.path.join(directory, "1"))
    return weights_state, _state(loaded)


def _lagging_listing_body(rank, world_size, directory):
    import keras
    from keras.src.backend.torch.distributed.checkpoints import checkpoint

    use_data_parallel()
    model = _model()
    callback = keras.callbacks.DistributedCheckpoint(
        directory, max_to_keep=2, save_on_background=False
    )
    _fit(model, 2, [callback])
    saved = _state(model)
    if rank == 1:
        # This process' listing lags: it sees the first step only.
        listed = checkpoint.complete_steps
        checkpoint.complete_steps = lambda d: listed(d)[:1]
    loaded = _model()
    loaded.load_weights(directory)
    return saved, _state(loaded), checkpoint.resolve(directory)


def test_every_process_loads_the_step_process_0_finds(tmp_path):
    per_rank = _on_2_ranks(_lagging_listing_body, tmp_path)
    for saved, loaded, step in per_rank:
        # The last step's model and optimizer, on both processes.
        assert os.path.basename(step) == "1", step
        _assert_states_equal(loaded, saved)


def _process_0_fails_body(rank, world_size, directory):
    import time

    from keras.src.backend.torch.distributed.checkpoints import process_io

    use_data_parallel()
    model = _model()
    start, errors = time.monotonic(), []
    # Process 0 cannot create its temporary file in a missing directory.
    try:
        model.save(os.path.join(directory, "missing", "model.keras"))
    except (OSError, RuntimeError) as error:
        errors.append(type(error).__name__)

    def fail():
        raise OSError("disk full")

    try:
        process_io.run_on_one_process(fail)
    except (OSError, RuntimeError) as error:
        errors.append(type(error).__name__)
    return errors, time.monotonic() - start


def test_an_error_of_process_0_writing_is_raised_on_every_process(tmp_path):
    per_rank = _on_2_ranks(_process_0_fails_body, tmp_path)
    (errors_0, seconds_0), (errors_1, seconds_1) = per_rank
    assert errors_0 == ["FileNotFoundError", "OSError"], errors_0
    assert errors_1 == ["RuntimeError", "RuntimeError"], errors_1
    # At once, not after a collective's timeout.
    assert max(seconds_0, seconds_1) < 30, (seconds_0, seconds_1)


def test_save_on_2x2_loads_anywhere(tmp_path):
    import keras

    directory = str(tmp_path / "ckpt")
    saved = run_on_ranks(
        _save_on_2x2, world_size=4, args=(directory,), timeout=TIMEOUT
    )
    # max_to_keep=2: the last two epochs' steps.
    assert saved[0]["steps"] == ["1", "2"]
    # Every process stored its own quarter of the 2-D sharded kernel in
    # its own file; the replicated variables are stored once.
    chunks = saved[0]["kernel_chunks"]
    rows, cols = saved[0]["local_kernel_shape"]
    assert chunks == {
        (0, 0): "__0_0.distcp",
        (0, cols): "__1_0.distcp",
        (rows, 0): "__2_0.distcp",
        (rows, cols): "__3_0.distcp",
    }
    assert len(saved[0]["files"]) == len(saved[0]["states"][-1])
    assert saved[0]["written_bytes"] == saved[0]["stored_bytes"]
    for result in saved[1:]:
        for a, b in zip(result["states"], saved[0]["states"]):
            _assert_states_equal(a, b)
    last, before = saved[0]["states"][-1], saved[0]["states"][-2]
    for setting in ("mp", "dp"):
        results = run_on_ranks(
            _load_body,
            world_size=2,
            args=(directory, setting),
            timeout=TIMEOUT,
        )
        for weights_state, model_state in results:
            _assert_states_equal(weights_state, last)
            _assert_states_equal(model_state, before)
    # One process, no distribution, no process group.
    model = _model()
    model.load_weights(directory)
    _assert_states_equal(_state(model), last)
    loaded = keras.saving.load_model(directory)
    _assert_states_equal(_state(loaded), last)
    assert int(loaded.optimizer.iterations) == 4 * EPOCHS


def _resume_body(rank, world_size, directory):
    import keras

    use_model_parallel(layout_rules=RULES_1X2, mesh_shape=(1, 2))
    model = _model()
    uninterrupted = _fit(model, 2)
    expected = _state(model)
    keras.backend.clear_session()
    # Keras master's `clear_session()` also unsets the distribution.
    use_model_parallel(layout_rules=RULES_1X2, mesh_shape=(1, 2))
    model = _model()
    callback = keras.callbacks.DistributedCheckpoint(directory)
    _fit(model, 1, [callback])
    del model
    resumed = keras.saving.load_model(directory)
    losses = _fit(resumed, 2, initial_epoch=1)
    return uninterrupted, losses, expected, _state(resumed)


def test_resume_equals_uninterrupted(tmp_path):
    results = _on_2_ranks(_resume_body, tmp_path)
    for uninterrupted, losses, expected, resumed in results:
        np.testing.assert_allclose(losses, uninterrupted[1:], rtol=1e-6)
        _assert_states_equal(resumed, expected)


def _save_every_batch(rank, world_size, directory, background):
    import keras

    use_model_parallel(layout_rules=RULES_1X2, mesh_shape=(1, 2))
    model = _model()
    callback = keras.callbacks.DistributedCheckpoint(
        directory,
        save_freq=1,
        max_to_keep=None,
        save_on_background=background,
    )
    _fit(model, 1, [callback])
    return sorted(os.listdir(directory))


def test_background_save_equals_synchronous(tmp_path):
    import keras

    steps = {}
    for background in (True, False):
        directory = str(tmp_path / f"background_{background}")
        results = run_on_ranks(
            _save_every_batch,
            world_size=2,
            args=(directory, background),
            timeout=TIMEOUT,
        )
        steps[background] = results[0]
    expected = [str(i) for i in range(1, 5)]
    assert sorted(steps[True], key=int) == expected
    assert steps[True] == steps[False]
    # Each step, loaded in this process, is the same whichever way it was
    # written; successive steps differ (training went on during saves).
    previous = None
    for step in expected:
        states = []
        for background in (True, False):
            model = _model()
            path = tmp_path / f"background_{background}" / step
            model.load_weights(path)
            states.append(_state(model))
            keras.backend.clear_session()
        _assert_states_equal(states[0], states[1])
        if previous is not None:
            assert not np.array_equal(states[0][0], previous[0])
        previous = states[0]


def _failed_save_body(rank, world_size, directory):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    import keras

    use_model_parallel(layout_rules=RULES_1X2, mesh_shape=(1, 2))
    model = _model()
    callback = keras.callbacks.DistributedCheckpoint(
        directory, save_on_background=False, max_to_keep=None
    )
    _fit(model, 1, [callback])
    saved = _state(model)
    write = FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        if rank == 1:
            raise OSError("disk full")
        return write(self, plan, planner)

    FileSystemWriter.write_data = failing_write
    try:
        _fit(model, 2, [callback], initial_epoch=1)
        error = None
    except CheckpointException as e:  # A BaseException.
        error = repr(e)
    finally:
        FileSystemWriter.write_data = write
    model = _model()
    model.load_weights(directory)
    return error, sorted(os.listdir(directory)), saved, _state(model)


def test_failed_save_keeps_previous_step(tmp_path):
    results = _on_2_ranks(_failed_save_body, tmp_path)
    for error, names, saved, loaded in results:
        assert error is not None and "disk full" in error
        assert names == [".partial-1", "0"]
        _assert_states_equal(loaded, saved)


def _save_and_die(directory, model):
    from torch.distributed.checkpoint import FileSystemWriter

    from keras.src.backend.torch.distributed.checkpoints import checkpoint

    # Killed once every shard is written, before the metadata is.
    FileSystemWriter.finish = lambda *args, **kwargs: os._exit(3)
    checkpoint.Checkpointer(directory).save(model, 2)


def test_killed_save_never_loads(tmp_path):
    import keras

    directory = str(tmp_path / "ckpt")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    checkpointer = keras.callbacks.DistributedCheckpoint(
        directory, save_freq=1, save_on_background=False
    )
    checkpointer.set_model(model)
    checkpointer.on_train_batch_end(0)
    expected = model.weights[0].numpy()
    model.weights[0].assign(np.zeros((3, 2)))
    # A process of its own (forked: keras is imported) to be killed.
    process = multiprocessing.get_context("fork").Process(
        target=_save_and_die, args=(directory, model)
    )
    process.start()
    process.join(timeout=120)
    assert process.exitcode == 3
    partial = os.path.join(directory, ".partial-2")
    assert sorted(os.listdir(directory)) == [".partial-2", "1"]
    assert any(n.endswith(".distcp") for n in os.listdir(partial))
    model.load_weights(directory)
    np.testing.assert_array_equal(model.weights[0].numpy(), expected)
    with pytest.raises(ValueError, match="interrupted"):
        model.load_weights(partial)


class _Interrupt(Exception):
    pass


def _backup_body(rank, world_size, directory):
    import keras

    use_data_parallel()
    model = _model()
    uninterrupted = _fit(model, EPOCHS)
    expected = _state(model)
    keras.backend.clear_session()
    # Keras master's `clear_session()` also unsets the distribution.
    use_data_parallel()

    def interrupt(epoch, logs):
        if epoch == 1:
            raise _Interrupt()

    backup = keras.callbacks.BackupAndRestore(
        directory, delete_checkpoint=False
    )
    model = _model()
    try:
        _fit(
            model,
            EPOCHS,
            [backup, keras.callbacks.LambdaCallback(on_epoch_end=interrupt)],
        )
    except _Interrupt:
        pass
    names = sorted(os.listdir(directory))
    shards = sorted(os.listdir(os.path.join(directory, "latest.checkpoint")))
    keras.backend.clear_session()
    use_data_parallel()
    model = _model()
    backup = keras.callbacks.BackupAndRestore(directory)
    resumed = _fit(model, EPOCHS, [backup])
    return uninterrupted, resumed, expected, _state(model), names, shards


def test_backup_and_restore_backs_up_through_dcp(tmp_path):
    directory = str(tmp_path / "backup")
    results = run_on_ranks(
        _backup_body, world_size=2, args=(directory,), timeout=TIMEOUT
    )
    for uninterrupted, resumed, expected, state, names, shards in results:
        assert names == ["latest.checkpoint", "training_metadata.json"]
        assert ".metadata" in shards and "__0_0.distcp" in shards
        np.testing.assert_allclose(resumed, uninterrupted[2:], rtol=1e-6)
        _assert_states_equal(state, expected)
    assert not os.path.exists(directory)


def test_errors(tmp_path, monkeypatch):
    import keras
    from keras.src.callbacks import distributed_checkpoint

    with pytest.raises(ValueError, match="save_freq"):
        keras.callbacks.DistributedCheckpoint(tmp_path, save_freq="batch")
    with pytest.raises(ValueError, match="max_to_keep"):
        keras.callbacks.DistributedCheckpoint(tmp_path, max_to_keep=0)
    # A checkpoint loads only into a model of the same architecture.
    with pytest.raises(ValueError, match="file system"):
        keras.callbacks.DistributedCheckpoint("gs://bucket/ckpt")
    # One process, no process group, a background save.
    model = _model()
    callback = keras.callbacks.DistributedCheckpoint(tmp_path)
    _fit(model, 1, [callback])
    reloaded = _model()
    reloaded.load_weights(tmp_path)
    _assert_states_equal(_state(reloaded), _state(model))
    fewer = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="has 4 model variables"):
        fewer.load_weights(tmp_path)
    other = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(5)]
    )
    with pytest.raises(ValueError, match=r"shape \(16, 4\).*\(16, 5\)"):
        other.load_weights(tmp_path)
    # A backend without the capability: a clear error, not an import one.
    monkeypatch.setattr(
        distributed_checkpoint, "distribution_capability", lambda name: None
    )
    with pytest.raises(ValueError, match="OrbaxCheckpoint"):
        keras.callbacks.DistributedCheckpoint(tmp_path)


def test_callback_module_imports_no_backend():
    # It must import under every backend: no torch (or other backend) at
    # module level; the backend's capability is asked for at construction.
    import ast

    from keras.src.callbacks import distributed_checkpoint

    tree = ast.parse(open(distributed_checkpoint.__file__).read())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert imported == {
        "warnings",
        "keras.src",
        "keras.src.api_export",
        "keras.src.backend.common.distribution_capability",
        "keras.src.callbacks.monitor_callback",
        "keras.src.utils",
    }


def test_save_freq_and_save_best_only(tmp_path):
    # One process: which steps are saved does not depend on the
    # distribution (every process sees the same logs).
    import keras

    def steps(name, **kwargs):
        directory = tmp_path / name
        callback = keras.callbacks.DistributedCheckpoint(
            directory, max_to_keep=None, save_on_background=False, **kwargs
        )
        losses = _fit(_model(), EPOCHS, [callback])
        return sorted(int(n) for n in os.listdir(directory)), losses

    # Every 3 batches of 4 per epoch, numbered by batches seen.
    assert steps("freq", save_freq=3)[0] == [3, 6, 9, 12]
    saved, losses = steps("min", monitor="loss", save_best_only=True)
    assert losses == sorted(losses, reverse=True)  # The loss decreases.
    assert saved == [0, 1, 2]
    # The loss never rises again: only the first epoch is the "best".
    assert steps("max", monitor="loss", mode="max", save_best_only=True)[0] == [
        0
    ]
    assert steps(
        "threshold",
        monitor="loss",
        save_best_only=True,
        initial_value_threshold=losses[1] * 1.0001,
    )[0] == [1, 2]
