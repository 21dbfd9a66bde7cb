"""Data sources read in parts: each process reads only its share.

A map-style `DataLoader` fetches only the samples of each process' rows
(processes that share rows along the model axis fetch the same ones); a
`PyDataset` is read in shares (batch i on process i % N) and the rows are
exchanged. Each run counts what every process read, and must train exactly
as one process does on the same data: per-epoch losses and metrics, final
weights and optimizer state, also with a shuffled order (a seeded
DataLoader generator; `PyDataset` shuffling from Keras' seeded state), and
then evaluate and predict the same.

The datasets count reads instead of doing work, so the tests stay cheap.
"""

import warnings

import numpy as np
import pytest

import keras
from tests import distributions
from tests import parity_models as pm
from tests.harness import run_on_ranks

NUM_SAMPLES = 22  # Batches of 8, 8, 6: a ragged last batch.
BATCH = 8
EPOCHS = 2
LOADER_SEED = 1234


class _CountingDataset:
    """A map-style torch dataset of the mlp data that records its reads."""

    def __init__(self, x, y):
        self.x, self.y, self.read = x, y, []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        self.read.append(int(index))
        return self.x[index], self.y[index]


class _CountingPyDataset(keras.utils.PyDataset):
    """Global batches of the mlp data; records the batches it reads."""

    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size, self.read = x, y, batch_size, []

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        self.read.append(int(index))
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


def _source(kind, num_samples, batch_size, shuffle, workers=1):
    """`(fit kwargs, dataset)` for `kind`: "dataloader" or "pydataset"."""
    import torch

    x, y = pm.make_data("mlp", num_samples=num_samples)
    if kind == "dataloader":
        dataset = _CountingDataset(x, y)
        generator = torch.Generator().manual_seed(LOADER_SEED)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, shuffle=shuffle, generator=generator
        )
        # The loader shuffles; Keras would only warn that it ignores its own
        # `shuffle=True` default.
        return {"x": loader, "shuffle": False}, dataset
    dataset = _CountingPyDataset(x, y, batch_size, workers=workers)
    return {"x": dataset, "shuffle": shuffle}, dataset


def _fit_source(
    kind,
    setting,
    *,
    num_samples=NUM_SAMPLES,
    batch_size=BATCH,
    shuffle=True,
    workers=1,
):
    """Fits the mlp on `kind`, then evaluates and predicts on it.

    Returns:
        `fit_result` with "evaluate" and "predict", and what `fit` read.
    """
    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    model = pm.build_model("mlp")
    fit_kwargs, dataset = _source(
        kind, num_samples, batch_size, shuffle, workers
    )
    history = model.fit(**fit_kwargs, epochs=EPOCHS, verbose=0)
    read = sorted(dataset.read)
    result = pm.fit_result(model, history)
    result["evaluate"] = model.evaluate(fit_kwargs["x"], verbose=0)
    result["predict"] = model.predict(fit_kwargs["x"], verbose=0)
    return result, read


def _fit_body(rank, world_size, kinds, setting, kwargs):
    results = {}
    for kind in kinds:
        keras.backend.clear_session()
        results[kind] = _fit_source(kind, setting, **kwargs)
    return results


def _assert_parity(per_rank, reference):
    for rank, result in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")


def _samples_read(kind, indices, batch_size):
    """Samples read: indices (DataLoader) or batches (PyDataset) x size."""
    if kind == "dataloader":
        return len(indices)
    return sum(min(batch_size, NUM_SAMPLES - i * batch_size) for i in indices)


@pytest.mark.parametrize("setting", ["dp", "2x2"])
def test_sources_read_their_share_and_train_as_one_process(setting):
    """2 processes (dp), a 2x2 mesh (DataLoader): shares read, same training.

    One process reads 2 epochs + Keras' peek at one batch: 52 samples.
    A batch-shard reads its rows: 2 x (4 + 4 + 3) + the peek's 4 = 26.
    A PyDataset process reads its batches (round-robin over all
    processes) + one batch in the peek round.
    """
    # The PyDataset on 4 processes: `test_last_batch_smaller_than_shards`.
    kinds = ("dataloader", "pydataset") if setting == "dp" else ("dataloader",)
    world_size = 2 if setting == "dp" else 4
    per_rank = run_on_ranks(
        _fit_body,
        world_size=world_size,
        args=(kinds, setting, {}),
    )
    for kind in kinds:
        reference, read_alone = pm.run_single(_fit_source, kind, "single")
        _assert_parity([r[kind][0] for r in per_rank], reference)
        reads = [r[kind][1] for r in per_rank]
        if kind == "dataloader":
            assert len(read_alone) == 52
            assert [len(r) for r in reads] == [26] * world_size, reads
            # Every sample is read once per epoch in all, as one process.
            batch_shards = reads if setting == "dp" else reads[::2]
            assert sorted(sum(batch_shards, [])) == read_alone
            if setting == "2x2":  # Model-axis neighbours share rows.
                assert reads[0] == reads[1] and reads[2] == reads[3]
        else:
            # 3 batches an epoch: 2 epochs + the peek round's batches.
            assert len(read_alone) == 7
            counts = [len(r) for r in reads]
            assert sum(counts) == 6 + min(world_size, 3), counts
            assert max(counts) <= -(-3 // world_size) * EPOCHS + 1, counts


def test_last_batch_smaller_than_shards():
    """9 samples, batch 4, 4 processes: the last batch has 1 row."""
    kwargs = {"num_samples": 9, "batch_size": 4, "shuffle": False}
    kinds = ("dataloader", "pydataset")
    per_rank = run_on_ranks(_fit_body, world_size=4, args=(kinds, "dp", kwargs))
    for kind in kinds:
        reference, _ = pm.run_single(_fit_source, kind, "single", **kwargs)
        _assert_parity([r[kind][0] for r in per_rank], reference)
    # 2 x (1 + 1 + 1: a row, or a probe for an empty part) + the peek's 1.
    reads = [r["dataloader"][1] for r in per_rank]
    assert [len(r) for r in reads] == [7, 7, 7, 7], reads


def _pydataset_workers_body(rank, world_size):
    keras.backend.clear_session()
    return _fit_source("pydataset", "dp", workers=2, shuffle=False)


def test_pydataset_workers_read_only_their_share():
    """With 2 reader threads, a process still reads only its batches.

    One process reads through Keras' enqueuer, which reads the 3 batches
    at each start (Keras' peek and each epoch), and takes those read ahead
    at an epoch's end first in the next one. The processes take turns
    over the same batches: each one is read once, on one process.
    """
    per_rank = run_on_ranks(_pydataset_workers_body, world_size=2)
    reference, read_alone = pm.run_single(
        _fit_source, "pydataset", "single", workers=2, shuffle=False
    )
    _assert_parity([r[0] for r in per_rank], reference)
    reads = [r[1] for r in per_rank]
    assert sorted(sum(reads, [])) == read_alone == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert reads == [[0, 0, 1, 2, 2], [0, 1, 1, 2]]


def _checks_body(rank, world_size):
    """Unseeded samplers that differ; `auto_shard_dataset=False`."""
    import torch

    from keras.src.backend.torch.distributed.inputs import data_sources
    from keras.src.trainers.data_adapters import get_data_adapter

    distributions.use_setting("dp")
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=NUM_SAMPLES)
    dataset = torch.utils.data.TensorDataset(
        torch.from_numpy(x), torch.from_numpy(y)
    )
    differing = torch.utils.data.DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(rank),
    )
    try:
        model.fit(differing, epochs=1, verbose=0)
        error = None
    except ValueError as e:
        error = str(e)
    distributions.use_setting("dp", auto_shard_dataset=False)
    kept = []
    for source in (differing, _CountingPyDataset(x, y, BATCH)):
        adapter = get_data_adapter(source)
        kept.append(data_sources.process_data_adapter(adapter) is adapter)
    return error, kept


def test_differing_sampler_orders_raise_and_own_parts_are_kept():
    for error, kept in run_on_ranks(_checks_body, world_size=2):
        assert error is not None and "different batches" in error, error
        assert kept == [True, True]


def test_counting_reference_reads_everything():
    """The single-process reference reads all data (the counts' baseline)."""
    _, read = pm.run_single(_fit_source, "dataloader", "single")
    assert sorted(set(read)) == list(range(NUM_SAMPLES))
    assert np.bincount(read).max() >= EPOCHS


class _SharedCountingDataset:
    """Counts reads in shared memory: the loader's worker processes read."""

    def __init__(self, x, y):
        import multiprocessing

        self.x, self.y = x, y
        context = multiprocessing.get_context("fork")
        self.counts = context.Array("i", len(x))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        with self.counts.get_lock():
            self.counts[index] += 1
        return self.x[index], self.y[index]


def _fit_loader_with_workers(setting, *, shuffle, epochs):
    """Fits the mlp on a DataLoader read by 2 worker processes.

    Returns:
        `(fit_result, indices of the samples read)`.
    """
    import torch

    distributions.use_setting(setting)
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=NUM_SAMPLES)
    dataset = _SharedCountingDataset(x, y)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=shuffle,
        num_workers=2,
        generator=torch.Generator().manual_seed(LOADER_SEED),
        # Forked, as under torchrun (Linux' default); the harness' ranks
        # are spawned processes, where spawn would be the default.
        multiprocessing_context="fork",
    )
    history = model.fit(loader, epochs=epochs, shuffle=False, verbose=0)
    read = [i for i, count in enumerate(dataset.counts) if count]
    return pm.fit_result(model, history), read


def _loader_workers_body(rank, world_size):
    keras.backend.clear_session()
    shuffled, _ = _fit_loader_with_workers("dp", shuffle=True, epochs=EPOCHS)
    keras.backend.clear_session()
    _, read = _fit_loader_with_workers("dp", shuffle=False, epochs=1)
    return shuffled, read


def test_loader_workers_fetch_own_rows_and_train_as_one_process():
    """`num_workers=2`: shuffled parity; in order, each its own rows only.

    The workers prefetch ahead of Keras' peek, so the counts vary; which
    samples a process reads does not: rows 0-3, 8-11, 16-18 of the 22 on
    process 0, the others on process 1.
    """
    per_rank = run_on_ranks(_loader_workers_body, world_size=2)
    reference, _ = pm.run_single(
        _fit_loader_with_workers, "single", shuffle=True, epochs=EPOCHS
    )
    _assert_parity([r[0] for r in per_rank], reference)
    own_rows = [
        [*range(0, 4), *range(8, 12), *range(16, 19)],
        [*range(4, 8), *range(12, 16), *range(19, 22)],
    ]
    assert [r[1] for r in per_rank] == own_rows


class _FailingDataset(_CountingDataset):
    """Fails on the second batch (rows 8-15, read ahead on both ranks)."""

    def __getitem__(self, index):
        if index >= BATCH:
            raise RuntimeError(f"sample {index} is corrupt")
        return super().__getitem__(index)


def _failing_read_body(rank, world_size):
    import torch

    distributions.use_setting("dp")
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=NUM_SAMPLES)
    loader = torch.utils.data.DataLoader(
        _FailingDataset(x, y), batch_size=BATCH, shuffle=False
    )
    try:
        model.fit(loader, epochs=1, verbose=0)
    except RuntimeError as e:
        return str(e)
    return None


def test_error_while_reading_ahead_is_raised_by_fit():
    """A sample that fails to load, read by the read-ahead thread."""
    errors = run_on_ranks(_failing_read_body, world_size=2, timeout=120)
    assert errors[0] is not None and "sample 8 is corrupt" in errors[0]
    assert errors[1] is not None and "sample 12 is corrupt" in errors[1]


class _FailingPyDataset(_CountingPyDataset):
    """Fails to read batch 1, which process 1 reads (batch `i` on `i % 2`)."""

    def __getitem__(self, index):
        if index == 1:
            raise ValueError("batch 1 is corrupt")
        return super().__getitem__(index)


def _failing_share_body(rank, world_size, workers):
    import os
    import time

    # Without the failure's report, process 0 would wait this long.
    os.environ["KERAS_DISTRIBUTION_TIMEOUT"] = "60"
    distributions.use_setting("dp")
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=NUM_SAMPLES)
    dataset = _FailingPyDataset(x, y, BATCH, workers=workers)
    started = time.monotonic()
    try:
        model.fit(dataset, epochs=1, shuffle=False, verbose=0)
    except (ValueError, RuntimeError) as e:
        return type(e).__name__, str(e), time.monotonic() - started
    return None


@pytest.mark.parametrize("workers", [0, 2])
def test_a_share_that_fails_to_read_stops_every_process(workers):
    """The reading process raises its dataset's error, the other one an
    error naming it, at once (in line and through the enqueuer)."""
    errors = run_on_ranks(
        _failing_share_body, world_size=2, args=(workers,), timeout=150
    )
    assert errors[1] is not None, errors
    assert errors[1][:2] == ("ValueError", "batch 1 is corrupt"), errors
    assert errors[0] is not None, errors
    assert errors[0][0] == "RuntimeError", errors
    assert "Process 1 failed to read a batch" in errors[0][1], errors
    assert max(e[2] for e in errors) < 30, errors


class _EpochShiftedPyDataset(_CountingPyDataset):
    """Batches that change at each `on_epoch_end` (as a reshuffle would)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epochs_ended = 0

    def on_epoch_end(self):
        self.epochs_ended += 1

    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return x, y + 0.5 * self.epochs_ended


def _epoch_within_pass(setting):
    """5 batches a pass, 3 steps an epoch: epochs end within passes."""
    distributions.use_setting(setting)
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=5 * BATCH)
    dataset = _EpochShiftedPyDataset(x, y, BATCH)
    history = model.fit(
        dataset, epochs=4, steps_per_epoch=3, shuffle=False, verbose=0
    )
    return pm.fit_result(model, history)


def _epoch_within_pass_body(rank, world_size):
    return _epoch_within_pass("dp")


def test_epoch_end_within_a_pass_reads_the_rest_anew():
    """What was read ahead before `on_epoch_end` is read again after it."""
    per_rank = run_on_ranks(_epoch_within_pass_body, world_size=2)
    # Epochs that meet a pass' end stop short: Keras warns that the input
    # ran out, on every process alike. (Not `pytest.warns`, which would show
    # again the warnings the test configuration filters.)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        reference = pm.run_single(_epoch_within_pass, "single")
    assert caught and all("ran out of data" in str(w.message) for w in caught)
    _assert_parity(per_rank, reference)


def test_batch_structures_are_mapped_as_tree_maps_them():
    """The step's own walk of a batch (lists, tuples and dicts of arrays,
    walked without `keras.tree`'s cost) gives `keras.tree`'s leaves and
    structure, and hands other containers to `keras.tree`."""
    import collections

    from keras.src import tree
    from keras.src.backend.torch.distributed.core import structures

    a, b = np.zeros((4, 2)), np.ones(4)
    pair = collections.namedtuple("pair", "p q")
    batches = [
        [(a, b)],
        [(a, b, None)],
        [({"x": a, "y": b}, b)],
        {"y": b, "x": (a, None)},
        [(pair(a, b), b)],
        [((a, [a, b]), b, np.float32(1.0))],
        [(a,)],
        a,
        [("text", 3, a)],
        collections.OrderedDict(x=a, y=[b, None]),
    ]
    for batch in batches:
        leaves = structures.flatten(batch)
        assert [id(x) for x in leaves] == [id(x) for x in tree.flatten(batch)]
        mapped = structures.map_structure(lambda x: ("leaf", id(x)), batch)
        expected = tree.map_structure(lambda x: ("leaf", id(x)), batch)
        assert mapped == expected
        assert type(mapped) is type(expected)
        assert str(mapped) == str(expected)  # Dicts' keys in their order.
        if isinstance(batch, list):
            assert type(mapped[0]) is type(expected[0])
