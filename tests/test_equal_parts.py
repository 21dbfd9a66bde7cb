"""Each process' own data (`auto_shard_dataset=False`): where every process'
batches have the same sizes, agreed as iterating starts, global batches are
assembled without exchanging sizes at each step; where they differ, sizes are
exchanged once a batch. Both train as one process on the global batches."""

import functools

import pytest

from tests import distributions
from tests import parity_models as pm
from tests.harness import run_on_ranks

VALIDATION_SAMPLES, BATCH, EPOCHS = 16, 8, 2


@functools.lru_cache(maxsize=None)
def _reference(samples):
    """One process without a distribution, on the global batches."""
    return pm.run_single(
        pm.fit_run,
        "mlp",
        "single",
        num_samples=samples,
        batch_size=BATCH,
        epochs=EPOCHS,
        validation_samples=VALIDATION_SAMPLES,
    )


def _own_rows_body(rank, world_size, samples, source):
    """Fits on this process' rows of each global batch from `source`
    (arrays or a `DataLoader`); returns the result and the number of sizes
    exchanges the batches took."""
    import torch

    from keras.src.backend.torch.distributed.inputs import data_input

    distributions.use_setting(
        "dp", layout_rules=pm.LAYOUT_RULES["mlp"], auto_shard_dataset=False
    )
    own = functools.partial(
        pm.local_rows, batch_size=BATCH, part=rank, num_parts=world_size
    )
    local_batch = -(-BATCH // world_size)

    def data(x, y):
        x, y = own(x), own(y)
        if source == "arrays":
            return x, y
        rows = torch.utils.data.TensorDataset(
            torch.from_numpy(x), torch.from_numpy(y)
        )
        return torch.utils.data.DataLoader(rows, batch_size=local_batch)

    x, y = pm.make_data("mlp", num_samples=samples)
    validation = pm.make_data("mlp", num_samples=VALIDATION_SAMPLES, seed=1)
    train, validation = data(x, y), data(*validation)
    # Arrays in batches of this process' part; a `DataLoader` as it batches.
    batch_size = local_batch if source == "arrays" else None
    train = train if source == "arrays" else (train, None)
    exchanges = []
    exchange = data_input._global_size

    def counted(*args):
        exchanges.append(args)
        return exchange(*args)

    model = pm.build_model("mlp")
    fit = dict(batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)
    data_input._global_size = counted
    try:
        history = model.fit(*train, validation_data=validation, **fit)
    finally:
        data_input._global_size = exchange
    return pm.fit_result(model, history), len(exchanges)


@pytest.mark.parametrize(
    "world_size, samples, source, exchanges",
    [
        (2, 22, "arrays", 0),
        (2, 22, "dataloader", 0),
        (4, 24, "arrays", 0),
        (2, 23, "arrays", 3 * EPOCHS),
        (4, 23, "dataloader", 3 * EPOCHS),
    ],
)
def test_own_rows_train_as_one_process(world_size, samples, source, exchanges):
    """Global batches of 8 rows: of 22 samples, 2 processes hold parts of 4,
    4 then 3 rows each; of 24, 4 processes parts of 2 rows: agreed, no
    exchange. Of 23, the last batch's parts differ (4 and 3 rows; 2, 2, 2
    and 1): sizes exchanged once for each training batch, its arrays x and
    y together. The validation batches' parts are all alike."""
    per_rank = run_on_ranks(
        _own_rows_body, world_size=world_size, args=(samples, source)
    )
    for result, exchanged in per_rank:
        assert exchanged == exchanges
        pm.assert_close(result, _reference(samples), "fit on own rows")
