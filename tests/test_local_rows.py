"""Data-parallel models of per-sample layers called on the local rows.

Under `DataParallel`, a model whose calls are per-sample runs its forward
and backward passes on each process' rows as plain tensors (`local_rows`),
whatever the classes of its layers (the probe of its first call,
`batch_coupling`); everything that reduces over the batch (the loss, the
metrics) keeps the global batch, and batch normalization's moments are
all-reduced. These tests check which models take that path, why the
others do not, and that they train as one process does.
"""

from tests import parity_models as pm
from tests.harness import run_on_ranks


def _counting_local_calls(function, *args):
    """`(function(*args), number of model calls made on the local rows)`.

    The probe's first call of each step function runs through DTensor: it
    is not counted.
    """
    from keras.src.backend.torch.distributed.data_parallel import local_rows

    calls = []
    call = local_rows._call_locally

    def counting_call(*call_args, **call_kwargs):
        outputs = call(*call_args, **call_kwargs)
        calls.append(outputs is not None)
        return outputs

    local_rows._call_locally = counting_call
    try:
        result = function(*args)
    finally:
        local_rows._call_locally = call
    return result, sum(calls)


def _counting_body(rank, world_size, fit):
    return _counting_local_calls(fit, rank, world_size)


def _counted_runs(fit):
    """`fit(rank, world_size)` on 2 ranks as `(result, local calls)` each,
    and `fit()`'s result in one process."""
    per_rank = run_on_ranks(_counting_body, world_size=2, args=(fit,))
    return per_rank, pm.run_single(fit)


def _fit_body(rank, world_size, kinds):
    return [_counting_local_calls(pm.fit_run, kind, "dp") for kind in kinds]


def test_per_sample_model_runs_on_local_rows_like_one_process():
    # Embedding, MultiHeadAttention, LayerNormalization, Dense, `x + y`,
    # GlobalAveragePooling1D. (The parity zoo also runs "mlp" and
    # "binary" on this path.)
    per_rank = run_on_ranks(_fit_body, world_size=2, args=(["attention"],))
    per_rank = [results[0] for results in per_rank]
    reference = pm.run_single(pm.fit_run, "attention", "single")
    for rank, (result, local_calls) in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
        # fit: 3 train steps a epoch, then validation, 2 epochs.
        assert local_calls >= 6, local_calls
    pm.assert_ranks_agree([r for r, _ in per_rank])


def test_a_job_of_one_process_runs_on_local_rows_too():
    # One process: the batch is left whole on the mesh's one device
    # (`Replicate`), which is that process' rows; DTensor's dispatch of
    # every op cost 1.9-4.1x one Keras process' step there.
    for kind in ("attention", "batchnorm"):
        ((results,),) = run_on_ranks(_fit_body, world_size=1, args=([kind],))
        result, local_calls = results
        pm.assert_close(result, pm.run_single(pm.fit_run, kind, "single"))
        assert local_calls >= 6, (kind, local_calls)


def test_batch_normalization_runs_on_local_rows_with_global_moments():
    # Its moments over the batch are all-reduced (`batch_moments`); its
    # moving statistics are written back. Parity (weights, moving
    # statistics included) with one process is checked here and in
    # test_training_parity.
    per_rank = run_on_ranks(_fit_body, world_size=2, args=(["batchnorm"],))
    reference = pm.run_single(pm.fit_run, "batchnorm", "single")
    for rank, results in enumerate(per_rank):
        result, local_calls = results[0]
        pm.assert_close(result, reference, f"rank {rank}")
        assert local_calls >= 6, local_calls


def _dropout_body(rank, world_size):
    """Local calls of a dropout model's train steps, then of `evaluate`."""
    from tests import distributions

    distributions.use_setting("dp", layout_rules=pm.LAYOUT_RULES["dropout"])
    model = pm.build_model("dropout")
    x, y = pm.make_data("dropout", num_samples=24)
    _, fit_calls = _counting_local_calls(
        lambda: model.fit(
            x, y, batch_size=8, epochs=2, shuffle=False, verbose=0
        )
    )
    _, evaluate_calls = _counting_local_calls(
        lambda: model.evaluate(x, y, batch_size=8, verbose=0)
    )
    return fit_calls, evaluate_calls


def test_models_drawing_random_numbers_run_on_local_rows():
    # A dropout mask is drawn by position: each process draws its rows of
    # the global batch's mask. After each step function's probe (its first
    # batch) the train steps (6 batches) and the test steps (3) run on the
    # local rows. Parity with one process under the same distribution is
    # checked in test_training_parity.
    per_rank = run_on_ranks(_dropout_body, world_size=2)
    for fit_calls, evaluate_calls in per_rank:
        assert fit_calls == 5, fit_calls
        assert evaluate_calls == 2, evaluate_calls


def _unseeded_draw_body(rank, world_size):
    """A fit of a model with a user's noise layer drawing `keras.random`
    without a seed: its result, verdict and calls on the local rows."""
    import numpy as np

    import keras
    from tests import distributions

    class Noise(keras.layers.Layer):
        def call(self, x, training=False):
            if not training:
                return x
            return x + 0.1 * keras.random.normal(keras.ops.shape(x))

    def fit():
        distributions.use_setting("dp")
        keras.utils.set_random_seed(pm.SEED)
        inputs = keras.Input((8,))
        outputs = keras.layers.Dense(2)(Noise()(keras.layers.Dense(8)(inputs)))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(16, 8)).astype("float32")
        y = rng.normal(size=(16, 2)).astype("float32")
        history = model.fit(
            x, y, batch_size=8, epochs=2, shuffle=False, verbose=0
        )
        verdict = distributions.call_verdict(model, "train", training=True)
        result = {
            "loss": history.history["loss"],
            "weights": [np.array(w) for w in model.get_weights()],
        }
        return result, verdict.per_sample, verdict.reason

    return _counting_local_calls(fit)


def test_a_draw_without_a_seed_runs_on_local_rows_like_one_process():
    # The draw keys from process 0's torch generator, one key a call (as a
    # dropout without a seed), not from Keras' global seed generator, a
    # variable outside the model. 2 epochs of 2 train steps, the first the
    # probe's; the numbers one process' under the same distribution.
    (one_process,) = run_on_ranks(_unseeded_draw_body, world_size=1)
    for (result, per_sample, reason), calls in run_on_ranks(
        _unseeded_draw_body, world_size=2
    ):
        assert per_sample and calls == 3, (reason, calls)
        pm.assert_close(result, one_process[0][0])


def _assigned_scale_fit(rank=None, world_size=None):
    """Trains a model whose user layer scales by a weight without gradient,
    which the user assigns between steps: `{losses, weights}`."""
    import numpy as np

    import keras
    from tests import distributions

    class Scale(keras.layers.Layer):
        def build(self, input_shape):
            self.scale = self.add_weight(
                shape=(), initializer="ones", trainable=False
            )

        def call(self, x):
            return x * self.scale

    distributions.use_setting("dp" if rank is not None else "single")
    keras.utils.set_random_seed(pm.SEED)
    scale = Scale()
    inputs = keras.Input((5,))
    hidden = scale(keras.layers.Dense(4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    losses = []
    for step in range(6):
        if step == 3:
            scale.scale.assign(3.0)
        losses.append(float(model.train_on_batch(x, y)))
    weights = [np.array(w.numpy()) for w in model.weights]
    return {"losses": losses, "weights": weights}


def test_a_weight_without_gradient_assigned_between_steps_is_read_anew():
    # The call on the rows reads such a weight's local tensor kept across
    # steps: an assignment between steps must reach it.
    per_rank, reference = _counted_runs(_assigned_scale_fit)
    assert reference["losses"][3] != reference["losses"][2]
    for rank, (result, local_calls) in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
        assert local_calls >= 5, local_calls


def _fit_functional(rank, build, rows, y_shape, batch_size):
    """Fits `keras.Model(*build(keras, ops))` on `rows` rows in batches of
    `batch_size` (under `DataParallel` if `rank` is given)."""
    import numpy as np

    import keras
    from keras import ops
    from tests import distributions

    distributions.use_setting("dp" if rank is not None else "single")
    keras.utils.set_random_seed(pm.SEED)
    model = keras.Model(*build(keras, ops))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 5)).astype("float32")
    y = rng.normal(size=(rows,) + y_shape).astype("float32")
    history = model.fit(
        x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0
    )
    weights = [np.array(w.numpy()) for w in model.weights]
    return {"loss": history.history["loss"], "weights": weights}


def _batch_centered_fit(rank=None, world_size=None):
    """Fits Dense layers around `x - mean(x over the batch)`.

    The mean is an op of the functional graph, not a layer: computed on a
    process' rows alone it would differ from one process.
    """

    def build(keras, ops):
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(4, name="hidden")(inputs)
        centered = hidden - ops.mean(hidden, axis=0, keepdims=True)
        return inputs, keras.layers.Dense(2, name="out")(centered)

    return _fit_functional(rank, build, 16, (2,), 8)


def test_batch_reducing_op_between_layers_runs_on_dtensor():
    per_rank, reference = _counted_runs(_batch_centered_fit)
    for rank, (result, local_calls) in enumerate(per_rank):
        assert local_calls == 0, local_calls
        pm.assert_close(result, reference, f"rank {rank}")


def _squeezed_fit(rank=None, world_size=None):
    """Fits a Dense layer whose `(rows, 1)` output is squeezed: on a process
    holding a single row of an uneven batch, the call gives a scalar."""

    def build(keras, ops):
        inputs = keras.Input((5,))
        return inputs, ops.squeeze(keras.layers.Dense(1)(inputs))

    # Batches of 4, 4 and 3 rows: the last splits 2 and 1.
    return _fit_functional(rank, build, 11, (), 4)


def test_an_uneven_batch_one_process_leaves_takes_all_through_dtensor():
    # The second process' single row gives a scalar, not its rows: every
    # process agrees to leave the local rows, or the others would wait in
    # collectives it no longer makes.
    per_rank, reference = _counted_runs(_squeezed_fit)
    for rank, (result, local_calls) in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
        # Only the first even batch after the probe ran on the rows.
        assert local_calls == 1, local_calls
    pm.assert_ranks_agree([result for result, _ in per_rank])


def _masked_batchnorm_fit(rank=None, world_size=None):
    """Embedding(mask_zero=True) -> BatchNormalization: its masked moments
    are sums over the rows it sees, so that layer alone runs through
    DTensor."""
    import numpy as np

    import keras
    from tests import distributions

    distributions.use_setting("dp" if rank is not None else "single")
    keras.utils.set_random_seed(pm.SEED)
    inputs = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(8, 4, mask_zero=True)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 8, size=(10, 5)).astype("int32")
    y = rng.normal(size=(10, 2)).astype("float32")
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    weights = [np.array(w) for w in model.get_weights()]
    return {"loss": history.history["loss"], "weights": weights}


def test_masked_batch_normalization_alone_runs_on_dtensor():
    per_rank, reference = _counted_runs(_masked_batchnorm_fit)
    for rank, (result, local_calls) in enumerate(per_rank):
        # 2 epochs of 3 train steps, the first the probe's; the rest of the
        # model on the local rows.
        assert local_calls == 5, local_calls
        pm.assert_close(result, reference, f"rank {rank}")


def _backend_nn():
    """The torch backend's `nn` module, on either Keras base (Keras master
    moved it to `torch/ops/nn.py`)."""
    import keras.src.backend.torch as torch_backend

    return getattr(torch_backend, "ops", torch_backend).nn


def _dtensor_moments_body(rank, world_size):
    """Batch moments of a batch-sharded DTensor: the values and gradients,
    and the collectives of the forward and backward passes."""
    import numpy as np
    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import keras
    from tests import distributions

    distribution = distributions.use_setting("dp")
    mesh = distribution.device_mesh.backend_mesh
    data = np.random.default_rng(0).normal(size=(8, 3, 4)).astype("float32")
    x = distribute_tensor(torch.from_numpy(data), mesh, [Shard(0)])
    x.requires_grad_()
    try:
        with CommDebugMode() as comms:
            mean, variance = _backend_nn().moments(x, axes=(0, 1))
            both = mean.full_tensor() + variance.full_tensor()
            (both * torch.arange(1.0, 5.0)).sum().backward()
    finally:
        keras.distribution.set_distribution(None)
    return {
        "collectives": comms.get_total_counts(),
        "mean": mean.full_tensor().detach().numpy(),
        "variance": variance.full_tensor().detach().numpy(),
        "grad": x.grad.full_tensor().numpy(),
    }


def test_batch_moments_of_a_dtensor_batch_are_reduced_once():
    # Batch normalization through DTensor (a compiled step, or a model
    # that runs through DTensor): the sums of x and x * x are packed into
    # one all-reduce, the only collective of the forward and backward
    # passes here (upstream's two means: 4), with one process' moments
    # and gradients.
    import numpy as np
    import torch

    per_rank = run_on_ranks(_dtensor_moments_body, world_size=2)
    data = np.random.default_rng(0).normal(size=(8, 3, 4)).astype("float32")
    x = torch.from_numpy(data).requires_grad_()
    mean = x.mean(dim=(0, 1))
    variance = x.var(dim=(0, 1), unbiased=False)
    weights = torch.arange(1.0, 5.0)
    ((mean + variance) * weights).sum().backward()
    for result in per_rank:
        assert result["collectives"] == 1, result["collectives"]
        np.testing.assert_allclose(result["mean"], mean.detach(), rtol=1e-5)
        np.testing.assert_allclose(
            result["variance"], variance.detach(), rtol=1e-5
        )
        np.testing.assert_allclose(result["grad"], x.grad, rtol=1e-4, atol=1e-6)


# Models whose path the probe decides; `(per-sample?, reason)` expected.
_PROBED = {
    # A user's layer (`matmul(x, w) + b`, relu), defined outside Keras.
    "own_layer": (True, ""),
    # A `Lambda` of an elementwise function.
    "lambda": (True, ""),
    # DTensor refuses the recurrent loop's op on a batch-split sequence
    # (computed on global values in the probe): per-sample all the same.
    "lstm": (True, ""),
    # A layer that divides by the batch size (DTensor issues no
    # collective, but its values on the local rows differ) and a user's
    # layer that mixes the samples of the batch (rolls it): the layer whose
    # outputs differ first alone runs through DTensor.
    "batch_size_as_number": (True, "its outputs on the local rows differ"),
    "own_batch_rolled": (True, "its outputs on the local rows differ"),
    # Samples mixed outside any layer's call (the batch flipped between
    # two layers): the next layer's inputs differ already, and the model
    # runs through DTensor.
    "batch_flipped": (False, "differ from DTensor's"),
    # An activity regularizer's loss, a sum over the global batch: its
    # layer alone runs through DTensor.
    "activity_regularizer": (True, "sums over the batch"),
    # A user's layer that adds a loss over the batch, and one that centers
    # its inputs on the batch's mean: each alone runs through DTensor.
    "own_add_loss": (True, "adds a loss"),
    # A user's layer with a weight that adds a loss of its outputs over the
    # batch and of its weight alone: the weight's gradient, partial from
    # the first, replicated from the second, is counted once.
    "own_weighted_loss": (True, "adds a loss"),
    "own_batch_centered": (True, "sums over the batch"),
    # A mean over the batch between two layers, outside any layer's call:
    # the model couples samples itself.
    "batch_centered": (False, "sums over the batch"),
}


def _probed_model(kind):
    import keras
    from keras import ops

    class OwnDense(keras.layers.Layer):
        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.units = units

        def build(self, shape):
            self.w = self.add_weight((shape[-1], self.units))
            self.b = self.add_weight((self.units,), initializer="zeros")

        def call(self, x):
            return ops.relu(ops.matmul(x, self.w) + self.b)

    class OverBatchSize(keras.layers.Layer):
        def call(self, x):
            return x / ops.cast(ops.shape(x)[0], x.dtype)

    class SquaresLoss(keras.layers.Layer):
        def call(self, x):
            self.add_loss(0.1 * ops.mean(ops.square(x)))
            return x

    class WeightedLoss(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight((shape[-1], shape[-1]))

        def call(self, x):
            y = ops.matmul(x, self.w)
            self.add_loss(0.1 * ops.mean(ops.square(y)))
            self.add_loss(0.5 * ops.sum(self.w**2))
            return y

    class BatchCentered(keras.layers.Layer):
        def call(self, x):
            return x - ops.mean(x, axis=0, keepdims=True)

    class BatchRolled(keras.layers.Layer):
        def call(self, x):
            return ops.roll(x, 1, axis=0)

    keras.utils.set_random_seed(pm.SEED)
    inputs = keras.Input((8,))
    x = keras.layers.Dense(8)(inputs)
    if kind == "own_layer":
        x = OwnDense(6)(OwnDense(6)(x))
    elif kind == "lambda":
        x = keras.layers.Lambda(lambda t: t * 2.0 + 1.0)(x)
    elif kind == "lstm":
        x = keras.layers.LSTM(4)(keras.layers.Reshape((2, 4))(x))
    elif kind == "batch_size_as_number":
        x = OverBatchSize()(x)
    elif kind == "activity_regularizer":
        x = keras.layers.Dense(6, activity_regularizer="l2")(x)
    elif kind == "own_add_loss":
        x = SquaresLoss()(OwnDense(6)(x))
    elif kind == "own_weighted_loss":
        x = WeightedLoss()(x)
    elif kind == "own_batch_centered":
        x = OwnDense(6)(BatchCentered()(x))
    elif kind == "batch_centered":
        x = x - ops.mean(x, axis=0, keepdims=True)
    elif kind == "own_batch_rolled":
        x = OwnDense(6)(BatchRolled()(x))
    elif kind == "batch_flipped":
        x = OwnDense(6)(ops.flip(x, axis=0))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _probed_fit(kind, distributed=False):
    import numpy as np

    from tests import distributions

    distributions.use_setting("dp" if distributed else "single")
    model = _probed_model(kind)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    result = {
        "loss": history.history["loss"],
        "weights": [np.array(w) for w in model.get_weights()],
    }
    verdict = distributions.call_verdict(model, "train", training=True)
    return result, verdict


def _probed_body(rank, world_size):
    out = {}
    for kind in _PROBED:
        (result, verdict), calls = _counting_local_calls(
            _probed_fit, kind, True
        )
        out[kind] = (result, verdict.per_sample, verdict.reason, calls)
    return out


def test_the_probe_decides_the_path_whatever_the_layers_classes():
    per_rank = run_on_ranks(_probed_body, world_size=2)
    for kind, (per_sample, reason) in _PROBED.items():
        reference, _ = pm.run_single(_probed_fit, kind)
        for rank, results in enumerate(per_rank):
            result, got_per_sample, got_reason, calls = results[kind]
            assert (got_per_sample, kind) == (per_sample, kind), got_reason
            assert reason in got_reason, (kind, got_reason)
            # 2 epochs of 2 train steps, the first one the probe's.
            assert calls == (3 if per_sample else 0), (kind, calls)
            pm.assert_close(result, reference, f"{kind}, rank {rank}")


def _replicated_weight_body(rank, world_size):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch.distributed.data_parallel import coupled_layers

    mesh = init_device_mesh("cpu", (world_size,))
    weight = torch.arange(6, dtype=torch.float32).reshape(3, 2) / 7.0
    rows = torch.arange(12, dtype=torch.float32).reshape(4, 3).cos()
    grads = {}
    # A loss of the weight alone: DTensor's gradient is replicated, every
    # process holding the whole; and one of a batch-sharded product: a
    # partial sum, each process its rows' part.
    for kind in ("weight_only", "rows"):
        leaf = weight.clone().requires_grad_()
        replicated = coupled_layers._replicated(leaf, mesh)
        if kind == "weight_only":
            loss = (replicated**2).sum()
        else:
            x = distribute_tensor(rows, mesh, [Shard(0)])
            loss = (x @ replicated).sum()
        loss.backward()
        # The step sums the processes' partial gradients.
        total = leaf.grad.clone()
        torch.distributed.all_reduce(total)
        grads[kind] = total.numpy()
    return grads


def test_a_coupled_layers_weight_gradient_is_counted_once():
    import numpy as np
    import torch

    weight = torch.arange(6, dtype=torch.float32).reshape(3, 2) / 7.0
    rows = torch.arange(12, dtype=torch.float32).reshape(4, 3).cos()
    expected = {"weight_only": 2 * weight.numpy()}
    expected["rows"] = (rows.sum(0, keepdim=True).T * torch.ones(1, 2)).numpy()
    for grads in run_on_ranks(_replicated_weight_body, world_size=2):
        for kind, grad in grads.items():
            np.testing.assert_allclose(grad, expected[kind], rtol=1e-6)


def _short_batch_fit(rank=None, world_size=None):
    """Fits on global batches of 3 and then 1 row, with a max over the batch
    in the model: on 2 processes the last batch leaves one without rows."""
    import numpy as np

    import keras
    from keras import ops
    from tests import distributions

    distributions.use_setting("dp" if rank is not None else "single")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3)(inputs)
    outputs = hidden - ops.max(hidden, axis=0, keepdims=True)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    x = np.arange(16, dtype="float32").reshape(4, 4) / 16
    losses = [
        float(model.train_on_batch(x[:3], x[:3, :3])),
        float(model.train_on_batch(x[3:], x[3:, :3])),
    ]
    return {"losses": losses, "weights": [w.numpy() for w in model.weights]}


def _short_batch_body(rank, world_size):
    import numpy as np

    from keras.src.backend.torch import distribution_lib

    result = _short_batch_fit(rank, world_size)
    x = np.zeros((1, 4), "float32")
    (laid_out,) = distribution_lib.distribute_global_batch(
        (x,), distribution_lib.current_distribution()
    )
    return result, [str(p) for p in laid_out.placements]


def test_a_batch_leaving_a_process_without_rows_is_gathered():
    # Sharded, the second process' empty part would fail in `max` alone
    # while the first went on.
    reference = pm.run_single(_short_batch_fit)
    per_rank = run_on_ranks(_short_batch_body, world_size=2)
    for rank, (result, placements) in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
        assert placements == ["R"], placements


def _attention_kernels_body(rank, world_size):
    import collections

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        result = pm.fit_run("attention", "dp")
    names = collections.Counter(event.name for event in profiler.events())
    kernels = {
        kind: names[f"aten::_scaled_dot_product_{kind}"]
        for kind in ("flash_attention_for_cpu", "attention_math")
    }
    return result, kernels


def test_attention_on_local_rows_runs_one_process_kernels():
    # A CPU mesh makes the step run math SDPA (DTensor has no rule for the
    # CPU flash kernel); calls on the local rows take the kernels enabled
    # outside it, as one process does, but the probe's check compares with
    # DTensor's output on DTensor's kernel.
    reference = pm.run_single(pm.fit_run, "attention", "single")
    for world_size in (1, 2):
        per_rank = run_on_ranks(_attention_kernels_body, world_size=world_size)
        for rank, (result, kernels) in enumerate(per_rank):
            pm.assert_close(result, reference, f"rank {rank} of {world_size}")
            # 6 train and 4 validation steps, the first of each the probe's
            # (a DTensor call and its check); the symbolic build's on meta.
            assert kernels["flash_attention_for_cpu"] >= 8, kernels
            assert kernels["attention_math"] <= 5, kernels
        pm.assert_ranks_agree([result for result, _ in per_rank])


def _mixed_fit(rank=None, world_size=None):
    """Losses and float32 weights of an MLP fitted under `mixed_bfloat16`
    (the layers compute in bfloat16 on float32 weights), under
    `DataParallel` where ranks are given, and the local calls it made."""
    import keras
    from tests import distributions

    setting = "single" if rank is None else "dp"
    distributions.use_setting(setting, layout_rules=pm.LAYOUT_RULES["mlp"])
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        model = pm.build_model("mlp")
        x, y = pm.make_data("mlp", num_samples=24)
        history, calls = _counting_local_calls(
            lambda: model.fit(
                x, y, batch_size=8, epochs=2, shuffle=False, verbose=0
            )
        )
        dtypes = sorted({str(v.dtype) for v in model.trainable_weights})
        weights = [keras.ops.convert_to_numpy(v) for v in model.weights]
        return history.history["loss"], weights, dtypes, calls
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def test_mixed_precision_on_local_rows_trains_as_one_process():
    # The local rows map each weight to its float32 tensor, the gradient's
    # leaf; each layer's read casts it to bfloat16 as it would in one
    # process. bfloat16 sums in another order: its rounding bounds the match.
    import numpy as np

    per_rank = run_on_ranks(_mixed_fit, world_size=2)
    losses, weights, dtypes, _ = pm.run_single(_mixed_fit)
    assert dtypes == ["float32"]
    for rank, (rank_losses, rank_weights, rank_dtypes, calls) in enumerate(
        per_rank
    ):
        assert rank_dtypes == dtypes, rank
        assert calls >= 5, (rank, calls)
        np.testing.assert_allclose(rank_losses, losses, rtol=2e-2)
        for actual, expected in zip(rank_weights, weights):
            np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-2)
    for actual, expected in zip(per_rank[1][1], per_rank[0][1]):
        np.testing.assert_array_equal(actual, expected)
