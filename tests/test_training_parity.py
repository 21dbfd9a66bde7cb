"""Training parity zoo: fit/evaluate/predict on 2 and 4 gloo ranks.

Every multi-rank run here must give what one process gives on the global
data: per-epoch losses and metrics, final weights and optimizer state
(float32, rtol 1e-4, atol 1e-6), predictions; and all ranks must agree.
The single-process references are computed in the pytest process with the
same builders (`tests/parity_models.py`) and the same Keras seed.

Settings (see `tests.distributions.use_setting`): "dp" = DataParallel on
all ranks, "mp" = ModelParallel on a (1, 2) ("batch", "model") mesh, "2x2"
= ModelParallel on a (2, 2) mesh of 4 ranks.

Bodies run in the harness workers; most are the generic `_call_body`,
which calls a module-level run function given as an argument, so that the
parent can call the very same function for its reference.
"""

import contextlib
import functools
import io
import os

import numpy as np
import pytest

import keras
from tests import distributions
from tests import parity_models as pm
from tests.harness import run_on_ranks

WORLD_SIZES = {"dp": 2, "mp": 2, "2x2": 4}


# --------------------------------------------------------------------------
# Helpers (parent side)
# --------------------------------------------------------------------------


def _call_body(rank, world_size, function, *args, **kwargs):
    """Generic body: `function(*args, **kwargs)` on every rank."""
    return function(*args, **kwargs)


def _on_ranks(setting, function, *args, world_size=None, **kwargs):
    """Per-rank results of `function(*args, **kwargs)` on `setting`'s ranks.

    `function` is a module-level function; `world_size` overrides the
    number of ranks of `setting`.
    """
    world_size = world_size or WORLD_SIZES[setting]
    return run_on_ranks(
        _call_body,
        world_size=world_size,
        args=(function, *args),
        kwargs=kwargs,
    )


@functools.lru_cache(maxsize=None)
def _reference(function, *args, **kwargs):
    """`function(*args, **kwargs)` here, with no distribution (cached)."""
    return pm.run_single(function, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _one_process_reference(function, kind, **kwargs):
    """`function(kind, "dp", **kwargs)` on one process under `DataParallel`
    (cached): the reference of a model that draws random numbers, which a
    distribution draws by position (the same numbers on any layout, not
    torch's generator's)."""
    (result,) = run_on_ranks(
        _call_body, world_size=1, args=(function, kind, "dp"), kwargs=kwargs
    )
    return result


def _fit_reference(kind, **kwargs):
    """The one-process reference of `pm.fit_run` for `kind`."""
    if kind in pm.RANDOM_KINDS:
        return _one_process_reference(pm.fit_run, kind, **kwargs)
    return _reference(pm.fit_run, kind, "single", **kwargs)


def _assert_parity(per_rank, reference):
    """Every rank's result equals the reference, and ranks agree."""
    for rank, result in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
    pm.assert_ranks_agree(per_rank)


def _assert_fit_parity(per_rank, reference):
    """`fit_result`s: parity, and the history holds Python floats."""
    _assert_parity(per_rank, reference)
    for result in per_rank:
        assert result["value_types"] == ["float"], result["value_types"]


# --------------------------------------------------------------------------
# 1. The zoo: every model kind under every setting
# --------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["dp", "mp", "2x2"])
@pytest.mark.parametrize("kind", pm.MODEL_KINDS)
def test_fit_parity(kind, setting):
    """fit (with validation) = one process: history, weights, optimizer."""
    # `fit_run`'s defaults on both sides (24 samples, batches of 8, 2
    # epochs, validation): the runs differ only in the distribution.
    per_rank = _on_ranks(
        setting, pm.fit_run, kind, setting, with_placements=True
    )
    placements = [result.pop("placements") for result in per_rank]
    reference = _fit_reference(kind)
    _assert_fit_parity(per_rank, reference)
    _assert_laid_out(placements[0], kind, setting)


def _assert_laid_out(placements, kind, setting):
    """The variables carry the layouts the setting asks for.

    So that a LayoutMap key matching nothing cannot make a model-parallel
    run silently replicated.
    """
    import re

    if setting == "dp":
        assert set(placements.values()) == {"(Replicate(),)"}, placements
        return
    for key in pm.variable_layout_keys(kind):
        matched = [p for p in placements if re.fullmatch(key, p)]
        assert matched, f"layout key {key!r} matched no variable"
        for path in matched:
            assert "Shard" in placements[path], (path, placements[path])


def test_batchnorm_moving_statistics_are_trained():
    """The BN moving stats compared above did move away from (0, 1).

    Guards the zoo test against comparing untouched initial values.
    """
    state = _reference(pm.fit_run, "batchnorm", "single")["state"]
    assert not np.allclose(state["bn/moving_mean"], 0.0)
    assert not np.allclose(state["bn/moving_variance"], 1.0)


# --------------------------------------------------------------------------
# 2. Ragged last batches
# --------------------------------------------------------------------------


@pytest.mark.parametrize("setting", ["dp", "2x2"])
def test_fit_ragged_last_batch(setting):
    """22 samples, batch 8: a last batch of 6 (3 rows per batch shard)."""
    per_rank = _on_ranks(setting, pm.fit_run, "mlp", setting, num_samples=22)
    reference = _reference(pm.fit_run, "mlp", "single", num_samples=22)
    _assert_fit_parity(per_rank, reference)


def test_fit_last_batch_smaller_than_shards():
    """9 samples, batch 4 on 4 batch shards: the last batch has 1 row."""
    per_rank = _on_ranks(
        "dp",
        pm.fit_run,
        "mlp",
        "dp",
        num_samples=9,
        batch_size=4,
        world_size=4,
    )
    reference = _reference(
        pm.fit_run, "mlp", "single", num_samples=9, batch_size=4
    )
    _assert_fit_parity(per_rank, reference)


# --------------------------------------------------------------------------
# 3. Other data sources
# --------------------------------------------------------------------------

DATA_SOURCES = ("dataloader", "pydataset", "generator")
SOURCE_SAMPLES = 22  # Ragged: batches of 8, 8, 6.
SOURCE_BATCH = 8


def _source_data(source):
    """`(fit kwargs)` feeding the mlp data from `source`, global batches."""
    x, y = pm.make_data("mlp", num_samples=SOURCE_SAMPLES)
    steps = -(-SOURCE_SAMPLES // SOURCE_BATCH)
    if source == "dataloader":
        import torch

        dataset = torch.utils.data.TensorDataset(
            torch.from_numpy(x), torch.from_numpy(y)
        )
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=SOURCE_BATCH, shuffle=False
        )
        return {"x": loader}
    if source == "pydataset":
        return {"x": _ArrayPyDataset(x, y, SOURCE_BATCH)}

    def batches():
        while True:  # Infinite, as Keras needs with `steps_per_epoch`.
            for start in range(0, SOURCE_SAMPLES, SOURCE_BATCH):
                stop = start + SOURCE_BATCH
                yield x[start:stop], y[start:stop]

    return {"x": batches(), "steps_per_epoch": steps}


class _ArrayPyDataset(keras.utils.PyDataset):
    """Global batches of `(x, y)` arrays."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


def _run_data_source(source, setting):
    """Fits the mlp for 2 epochs on `source`; returns `fit_result`."""
    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    model = pm.build_model("mlp")
    history = model.fit(
        **_source_data(source), epochs=2, shuffle=False, verbose=0
    )
    return pm.fit_result(model, history)


def _run_all_data_sources(setting):
    """`{source: fit_result}` for every data source, one after another."""
    results = {}
    for source in DATA_SOURCES:
        keras.backend.clear_session()
        results[source] = _run_data_source(source, setting)
    return results


def test_fit_data_sources():
    """DataLoader, PyDataset, generator under DataParallel = one process.

    They also equal the numpy-input run on the same data (same batches).
    """
    per_rank = _on_ranks("dp", _run_all_data_sources, "dp")
    numpy_reference = _reference(
        pm.fit_run,
        "mlp",
        "single",
        num_samples=SOURCE_SAMPLES,
        batch_size=SOURCE_BATCH,
        epochs=2,
        validation=False,
    )
    for source in DATA_SOURCES:
        reference = _reference(_run_data_source, source, "single")
        _assert_fit_parity([r[source] for r in per_rank], reference)
        pm.assert_close(reference, numpy_reference, f"{source} vs numpy")


# --------------------------------------------------------------------------
# 4. auto_shard_dataset=False: each rank passes its own rows
# --------------------------------------------------------------------------


def _run_own_rows(setting):
    """Fit with `auto_shard_dataset=False` on this rank's rows only."""
    import torch.distributed as dist

    part, num_parts = pm.batch_part(
        setting, rank=dist.get_rank(), world_size=dist.get_world_size()
    )
    distributions.use_setting(
        setting,
        layout_rules=pm.LAYOUT_RULES["mlp"],
        auto_shard_dataset=False,
    )
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=22)
    x_val, y_val = pm.make_data("mlp", num_samples=10, seed=1)
    own = functools.partial(
        pm.local_rows, batch_size=8, part=part, num_parts=num_parts
    )
    local_batch = -(-8 // num_parts)
    history = model.fit(
        own(x),
        own(y),
        batch_size=local_batch,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(own(x_val), own(y_val)),
    )
    return pm.fit_result(model, history)


@pytest.mark.parametrize("setting", ["dp", "2x2"])
def test_fit_without_auto_sharding_on_own_rows(setting):
    """Per-rank parts of the global batches give the global training."""
    per_rank = _on_ranks(setting, _run_own_rows, setting)
    reference = _reference(pm.fit_run, "mlp", "single", num_samples=22)
    _assert_fit_parity(per_rank, reference)


# --------------------------------------------------------------------------
# 5. A custom torch train_step
# --------------------------------------------------------------------------


def _run_custom_step(setting):
    """Fits a `CustomStepModel` (torch `train_step`) for 2 epochs."""
    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    model = pm.build_custom_step_model("mlp")
    x, y = pm.make_data("mlp", num_samples=22)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return pm.fit_result(model, history)


@pytest.mark.parametrize("setting", ["dp", "2x2"])
def test_custom_train_step(setting):
    """loss.backward() + optimizer.apply in a user train_step = 1 process.

    And equals Keras' own train_step on the same data.
    """
    per_rank = _on_ranks(setting, _run_custom_step, setting)
    reference = _reference(_run_custom_step, "single")
    _assert_fit_parity(per_rank, reference)
    builtin = _reference(
        pm.fit_run,
        "mlp",
        "single",
        num_samples=22,
        batch_size=8,
        epochs=2,
        validation=False,
    )
    pm.assert_close(reference["state"], builtin["state"], "custom vs builtin")


# --------------------------------------------------------------------------
# 6. train/test/predict_on_batch, evaluate, predict
# --------------------------------------------------------------------------


def _run_batch_methods(setting, *, num_samples=22, batch_size=8):
    """The batch-level methods, evaluate and predict on the mlp."""
    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=num_samples)
    result = {
        "train_1": model.train_on_batch(
            x[:batch_size], y[:batch_size], return_dict=True
        ),
        "train_2": model.train_on_batch(
            x[batch_size:], y[batch_size:], return_dict=True
        ),
        # A batch whose size is not a multiple of the number of shards.
        "test": model.test_on_batch(x[:3], y[:3], return_dict=True),
        "predict_on_batch": np.asarray(model.predict_on_batch(x[:5])),
        "evaluate": model.evaluate(
            x, y, batch_size=batch_size, verbose=0, return_dict=True
        ),
        "predict": model.predict(x, batch_size=batch_size, verbose=0),
    }
    result["types"] = {
        name: type(result[name]).__name__
        for name in ("predict", "predict_on_batch")
    }
    result["state"] = pm.model_state(model)
    return result


BATCH_METHOD_CASES = [
    ("dp", 2, 22, 8),
    ("mp", 2, 22, 8),
    ("2x2", 4, 22, 8),
    # The last predict batch (1 row) is smaller than the 4 batch shards.
    ("dp", 4, 9, 4),
]


@pytest.mark.parametrize(
    "setting,world_size,num_samples,batch_size", BATCH_METHOD_CASES
)
def test_batch_methods_evaluate_predict(
    setting, world_size, num_samples, batch_size
):
    """Every rank gets the full global numpy predictions and metrics."""
    per_rank = _on_ranks(
        setting,
        _run_batch_methods,
        setting,
        num_samples=num_samples,
        batch_size=batch_size,
        world_size=world_size,
    )
    reference = _reference(
        _run_batch_methods,
        "single",
        num_samples=num_samples,
        batch_size=batch_size,
    )
    assert reference["predict"].shape == (num_samples, 3)
    for result in per_rank:
        assert result["types"] == {
            "predict": "ndarray",
            "predict_on_batch": "ndarray",
        }
        assert result["predict"].shape == (num_samples, 3)
    _assert_parity(per_rank, reference)


# Sizes of the many-predictions run: every remainder modulo the batch of 4
# (and modulo 2 ranks), up to 20 steps per call.
PREDICT_SIZES = tuple(range(3, 80, 3))


def _run_many_predictions(setting):
    """`predict` (batch 4) on the mlp for each of `PREDICT_SIZES` rows."""
    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    model = pm.build_model("mlp")
    x, _ = pm.make_data("mlp", num_samples=max(PREDICT_SIZES))
    return {
        str(size): model.predict(x[:size], batch_size=4, verbose=0)
        for size in PREDICT_SIZES
    }


def test_predict_many_ragged_sizes():
    """Many predict calls and steps, every kind of ragged last batch.

    Each step's outputs also go to the predict callbacks: gathering them
    must not interleave with other collectives of the ranks.
    """
    per_rank = _on_ranks("dp", _run_many_predictions, "dp")
    _assert_parity(per_rank, _reference(_run_many_predictions, "single"))


# --------------------------------------------------------------------------
# 7. Count metrics
# --------------------------------------------------------------------------


def _run_count_metrics(setting):
    """Fits/evaluates the binary classifier; also its own predictions."""
    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["binary"])
    model = pm.build_model("binary")
    x, y = pm.make_data("binary", num_samples=22)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    result = pm.fit_result(model, history)
    result["evaluate"] = model.evaluate(
        x, y, batch_size=8, verbose=0, return_dict=True
    )
    # One batch, no callbacks: `predict` itself is tested elsewhere.
    result["predict"] = np.asarray(model.predict_on_batch(x))
    return result


@pytest.mark.parametrize("setting", ["dp", "2x2"])
def test_count_metrics(setting):
    """TruePositives/accuracy equal one process (not times the shards)."""
    per_rank = _on_ranks(setting, _run_count_metrics, setting)
    _assert_fit_parity(per_rank, _reference(_run_count_metrics, "single"))
    _, y = pm.make_data("binary", num_samples=22)
    for result in per_rank:
        # Consistent with the run's own predictions, counted in numpy.
        predicted = result["predict"] > 0.5
        true_positives = float(np.sum(predicted & (y > 0.5)))
        accuracy = float(np.mean(predicted == (y > 0.5)))
        assert result["evaluate"]["tp"] == true_positives
        np.testing.assert_allclose(
            result["evaluate"]["binary_accuracy"], accuracy, rtol=1e-6
        )
        assert all(0 <= tp <= y.sum() for tp in result["history"]["tp"])


# --------------------------------------------------------------------------
# 8. Saving and loading
# --------------------------------------------------------------------------

# Layouts of the mlp on the 4-rank mesh, unlike those it is saved with.
RESHARDED_LAYOUTS = {
    "hidden/kernel": ("model", "batch"),
    "hidden/bias": ("batch",),
    "out/kernel": (("batch", "model"), None),
}


def _run_save(setting, directory):
    """Fits the mlp 1 epoch, saves model and weights from every rank."""
    os.makedirs(directory, exist_ok=True)
    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=22)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.save(os.path.join(directory, "m.keras"))
    model.save_weights(os.path.join(directory, "m.weights.h5"))
    return {
        "state": pm.model_state(model),
        "files": sorted(os.listdir(directory)),
    }


def _run_load_resharded(directory):
    """Loads the 2-rank weights into the mlp sharded differently (2x2)."""
    distributions.use_setting("2x2", layout_rules=RESHARDED_LAYOUTS)
    model = pm.build_model("mlp")
    model.optimizer.build(model.trainable_variables)
    before = pm.placements(model)
    model.load_weights(os.path.join(directory, "m.weights.h5"))
    return {
        "state": pm.model_state(model),
        "before": before,
        "after": pm.placements(model),
    }


def _load_state_here(path):
    """State of the model saved at `path`, loaded in this process."""
    return pm.model_state(keras.saving.load_model(path))


def test_save_and_load(tmp_path):
    """Saved by 2 ranks: loads in one process, and into 4 other shards."""
    directory = str(tmp_path)
    saved = _on_ranks("mp", _run_save, "mp", directory)
    pm.assert_ranks_agree(saved)
    # Only the two files: no temporary left behind by the atomic writes.
    assert saved[0]["files"] == ["m.keras", "m.weights.h5"]
    assert sorted(os.listdir(directory)) == ["m.keras", "m.weights.h5"]
    loaded = pm.run_single(_load_state_here, os.path.join(directory, "m.keras"))
    pm.assert_close(loaded, saved[0]["state"], "load_model")
    # The saved state is the trained one (equal to one process' training).
    reference = pm.run_single(_run_save, "single", str(tmp_path / "ref"))
    pm.assert_close(saved[0]["state"], reference["state"], "vs one process")

    restored = _on_ranks("2x2", _run_load_resharded, directory)
    pm.assert_ranks_agree([r["state"] for r in restored])
    pm.assert_close(restored[0]["state"], saved[0]["state"], "load_weights")
    for result in restored:
        assert result["after"] == result["before"]
    placements = restored[0]["after"]
    assert placements["hidden/kernel"] == "(Shard(dim=1), Shard(dim=0))"
    assert placements["hidden/bias"] == "(Shard(dim=0), Replicate())"
    assert placements["out/kernel"] == "(Shard(dim=0), Shard(dim=0))"


def _run_model_checkpoint(directory):
    """fit 2 epochs with ModelCheckpoint(save_best_only=False)."""
    distributions.use_data_parallel()
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=22)
    checkpoint = keras.callbacks.ModelCheckpoint(
        os.path.join(directory, "ckpt-{epoch}.keras"), save_best_only=False
    )
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[checkpoint],
    )
    return pm.model_state(model)


def test_model_checkpoint_writes_loadable_files(tmp_path):
    """ModelCheckpoint under 2 ranks: one loadable file per epoch."""
    directory = str(tmp_path)
    per_rank = _on_ranks("dp", _run_model_checkpoint, directory)
    pm.assert_ranks_agree(per_rank)
    assert sorted(os.listdir(directory)) == ["ckpt-1.keras", "ckpt-2.keras"]
    final = pm.run_single(
        _load_state_here, os.path.join(directory, "ckpt-2.keras")
    )
    pm.assert_close(final, per_rank[0], "ckpt-2.keras")
    first = pm.run_single(
        _load_state_here, os.path.join(directory, "ckpt-1.keras")
    )
    assert not np.allclose(first["hidden/kernel"], final["hidden/kernel"])


def _run_backup_and_restore(directory):
    """fit with BackupAndRestore keeping its backup; then fits whose
    BackupAndRestore deletes its backup at the end (the default)."""
    distributions.use_data_parallel()
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=22)
    backup = keras.callbacks.BackupAndRestore(
        os.path.join(directory, "backup"), delete_checkpoint=False
    )
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[backup],
    )
    state = pm.model_state(model)
    deleted = []
    for i in range(3):  # Every rank creates, writes and deletes the dir.
        path = os.path.join(directory, f"deleted_backup_{i}")
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(path)],
        )
        deleted.append(not os.path.exists(path))
    return {"state": state, "deleted": deleted}


def _load_weights_here(path):
    """State of a fresh mlp (single process) after `load_weights(path)`."""
    model = pm.build_model("mlp")
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return pm.model_state(model)


def test_backup_and_restore_writes_loadable_files(tmp_path):
    """BackupAndRestore under 2 ranks: its weights load; deletion works."""
    directory = str(tmp_path)
    per_rank = _on_ranks("dp", _run_backup_and_restore, directory)
    pm.assert_ranks_agree([r["state"] for r in per_rank])
    assert all(r["deleted"] == [True] * 3 for r in per_rank)
    assert sorted(os.listdir(directory)) == ["backup"]
    # Under a distribution the backup is a sharded (DCP) checkpoint.
    backup = pm.run_single(
        _load_weights_here,
        os.path.join(directory, "backup", "latest.checkpoint"),
    )
    pm.assert_close(backup, per_rank[0]["state"], "BackupAndRestore weights")


# --------------------------------------------------------------------------
# 9. Progress output
# --------------------------------------------------------------------------


def _run_verbose(setting):
    """fit/evaluate/predict with verbose=1; returns what was printed."""
    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=22)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=1)
        model.evaluate(x, y, batch_size=8, verbose=1)
        model.predict(x, batch_size=8, verbose=1)
    return buffer.getvalue()


def test_progress_printed_by_rank_zero_only():
    """verbose=1: rank 0 prints the progress bars, rank 1 nothing."""
    texts = _on_ranks("dp", _run_verbose, "dp")
    assert "Epoch 1/2" in texts[0] and "Epoch 2/2" in texts[0]
    assert "loss" in texts[0] and "mae" in texts[0]
    assert "3/3" in texts[0]  # 3 steps per epoch (and predict, evaluate).
    assert texts[1] == ""


# --------------------------------------------------------------------------
# 10. RNG: differently seeded ranks, no Keras seed
# --------------------------------------------------------------------------


def _run_unseeded(setting):
    """Build and fit with per-rank seeds and no Keras seed.

    Returns the global values and this rank's local values of every
    replicated variable (the local value of a replicated variable is all
    of it), and this rank's local rows of an unseeded dropout applied to
    a batch.
    """
    import random

    import torch
    import torch.distributed as dist

    from keras.src.utils import rng_utils

    rank, world_size = dist.get_rank(), dist.get_world_size()
    distributions.use_setting(
        setting, layout_rules=pm.LAYOUT_RULES["unseeded_dropout"]
    )
    # Per-rank seeds right before building (after `set_distribution`), as
    # a script seeding its own per-rank randomness would.
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    assert rng_utils.get_random_seed() is None
    model = pm.build_model("unseeded_dropout", seed=None)
    initial = pm.model_state(model)
    x, y = pm.make_data("unseeded_dropout", num_samples=22)
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    replicated = {
        v.path: np.array(v.value.to_local().detach())
        for v in model.weights
        if all(p.is_replicate() for p in v.value.placements)
    }
    batch = keras.ops.convert_to_tensor(x[:8])
    layout = keras.distribution.distribution().get_data_layout(batch.shape)
    dropped = model.get_layer("drop")(
        keras.distribution.distribute_tensor(batch, layout), training=True
    )
    return {
        "agreed": {
            "initial": initial,
            "history": history.history,
            "final": pm.model_state(model),
            "replicated": replicated,
        },
        "dropout_rows": np.array(dropped.to_local().detach()),
        "part": pm.batch_part(setting, rank=rank, world_size=world_size)[0],
    }


@functools.lru_cache(maxsize=None)
def _unseeded_results(setting):
    """Per-rank results of `_run_unseeded` (one run for both tests)."""
    return _on_ranks(setting, _run_unseeded, setting)


@pytest.mark.parametrize("setting", ["dp", "2x2"])
def test_unseeded_variables_agree(setting):
    """Weights, optimizer state and history agree across differently seeded
    ranks (initial values, and after a fit with an unseeded dropout)."""
    per_rank = _unseeded_results(setting)
    pm.assert_ranks_agree([r["agreed"] for r in per_rank])
    replicated = per_rank[0]["agreed"]["replicated"]
    assert "out/bias" in replicated
    if setting == "dp":
        assert "hidden/kernel" in replicated


@pytest.mark.parametrize("setting", ["dp", "2x2"])
def test_unseeded_dropout_masks_agree_on_replicas(setting):
    """Ranks holding the same rows of a replicated activation draw the
    same unseeded dropout mask (else the replicas silently diverge)."""
    per_rank = _unseeded_results(setting)
    by_part = {}
    for result in per_rank:
        by_part.setdefault(result["part"], []).append(result["dropout_rows"])
    x, _ = pm.make_data("unseeded_dropout", num_samples=8)
    for part, rows in by_part.items():
        for rank_rows in rows[1:]:
            np.testing.assert_array_equal(rank_rows, rows[0])
        expected_rows = pm.local_rows(
            x, batch_size=8, part=part, num_parts=len(by_part)
        )
        kept = rows[0] != 0
        assert 0 < kept.mean() < 1  # A real mask, rate 0.5.
        np.testing.assert_allclose(
            rows[0][kept], 2 * expected_rows[kept], rtol=1e-6
        )


# --------------------------------------------------------------------------
# Every optimizer Keras exports
# --------------------------------------------------------------------------


def _optimizers():
    """`{name: optimizer factory}` of every Keras optimizer, with options
    that exercise its state (momentum, weight decay, EMA, loss scaling)."""
    import keras

    o = keras.optimizers
    return {
        "Adadelta": lambda: o.Adadelta(1.0),
        "Adafactor": lambda: o.Adafactor(0.05),
        "Adagrad": lambda: o.Adagrad(0.1),
        "Adam": lambda: o.Adam(0.01, amsgrad=True),
        "AdamW": lambda: o.AdamW(0.01, weight_decay=0.1),
        "Adamax": lambda: o.Adamax(0.01),
        "Ftrl": lambda: o.Ftrl(0.1, l1_regularization_strength=0.01),
        "Lamb": lambda: o.Lamb(0.01),
        "Lion": lambda: o.Lion(0.01),
        "LossScaleOptimizer": lambda: o.LossScaleOptimizer(o.SGD(0.1)),
        "Muon": lambda: o.Muon(0.01),
        "Nadam": lambda: o.Nadam(0.01),
        "RMSprop": lambda: o.RMSprop(0.01, momentum=0.5, centered=True),
        "SGD": lambda: o.SGD(0.1, momentum=0.9, nesterov=True),
        "SGD-ema": lambda: o.SGD(0.1, use_ema=True, ema_overwrite_frequency=2),
        "ScheduleFreeAdamW": lambda: o.ScheduleFreeAdamW(0.01),
    }


def _run_optimizers(setting):
    """Three steps of the MLP with each optimizer: losses, weights and the
    optimizer's own variables."""
    import keras

    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    x, y = pm.make_data("mlp", num_samples=16)
    results = {}
    for name, make in _optimizers().items():
        model = pm.build_model("mlp", compile_model=False)
        model.compile(optimizer=make(), loss="mse")
        losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
        results[name] = {
            "losses": losses,
            "weights": [np.asarray(w) for w in model.get_weights()],
            "optimizer": [
                keras.ops.convert_to_numpy(v) for v in model.optimizer.variables
            ],
        }
    return results


@pytest.mark.parametrize("setting", ["dp", "2x2"])
def test_every_optimizer_trains_as_one_process(setting):
    """Replicated state updated on its local tensors (`DataParallel`),
    sharded state through DTensor (a 2x2 mesh)."""
    per_rank = _on_ranks(setting, _run_optimizers, setting)
    reference = _reference(_run_optimizers, "single")
    assert sorted(reference) == sorted(_optimizers())
    _assert_parity(per_rank, reference)
