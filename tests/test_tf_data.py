"""`tf.data.Dataset` input under multi-process distributions.

A dataset whose batch size upstream's sharding can compute (static,
evenly split) is sharded upstream's way; any other, e.g. batches passed
through `map` and `prefetch` as keras-hub's `fit` builds them, is read as
global batches, each process keeping its rows. Both must train as one
process does on the same batches (the numpy-input run), on every process,
with validation data alike.
"""

import pytest

from tests import distributions
from tests import parity_models as pm
from tests.harness import run_on_ranks

# "mapped": 22 samples in batches of 8, 8, 6 through map + prefetch: the
# batch size is unknown to upstream. "static": 24 samples in batches of 8
# with `drop_remainder=True`: sharded upstream's way.
PIPELINES = {"mapped": 22, "static": 24}
BATCH = 8


def _dataset(pipeline, x, y):
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if pipeline == "static":
        return dataset.batch(BATCH, drop_remainder=True)
    return (
        dataset.batch(BATCH)
        .map(lambda a, b: (a * 1.0, b), num_parallel_calls=2)
        .prefetch(2)
    )


def _fit_on_tf_data(pipeline, setting):
    """Fits the mlp for 2 epochs on `pipeline`, validating on tf.data."""
    import keras
    from keras.src.trainers.data_adapters import get_data_adapter

    keras.backend.clear_session()
    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    model = pm.build_model("mlp")
    x, y = pm.make_data("mlp", num_samples=PIPELINES[pipeline])
    x_val, y_val = pm.make_data("mlp", num_samples=10, seed=1)
    dataset = _dataset(pipeline, x, y)
    history = model.fit(
        dataset,
        epochs=2,
        verbose=0,
        validation_data=_dataset("mapped", x_val, y_val),
    )
    result = pm.fit_result(model, history)
    result["adapter"] = type(get_data_adapter(dataset)).__name__
    return result


def _fit_all_pipelines(rank, world_size, setting):
    return {p: _fit_on_tf_data(p, setting) for p in PIPELINES}


def _numpy_reference(pipeline):
    return pm.run_single(
        pm.fit_run,
        "mlp",
        "single",
        num_samples=PIPELINES[pipeline],
        batch_size=BATCH,
        epochs=2,
    )


@pytest.mark.parametrize("setting", ["dp", "2x2"])
def test_fit_on_tf_data(setting):
    world_size = {"dp": 2, "mp": 2, "2x2": 4}[setting]
    per_rank = run_on_ranks(
        _fit_all_pipelines, world_size=world_size, args=(setting,)
    )
    for pipeline in PIPELINES:
        results = [r[pipeline] for r in per_rank]
        adapters = {r.pop("adapter") for r in results}
        expected = {
            "static": "_ProcessPartsAdapter",
            "mapped": "TFDatasetAdapter",
        }[pipeline]
        assert adapters == {expected}, (pipeline, adapters)
        reference = _numpy_reference(pipeline)
        for rank, result in enumerate(results):
            pm.assert_close(result, reference, f"{pipeline} rank {rank}")
        pm.assert_ranks_agree(results, pipeline)
