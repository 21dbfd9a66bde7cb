"""Gradient buckets all-reduced during the backward pass (DDP's reducer).

Under `DataParallel`, Keras' train step launches each gradient bucket's
all-reduce as soon as the backward pass has accumulated the bucket's
gradients, and waits for them before the optimizer. The test models are
far below one bucket, so the bodies shrink the buckets to one variable
each: every bucket but the last is then reduced during the backward pass.
"""

from tests import distributions
from tests import parity_models as pm
from tests.harness import run_on_ranks


def _with_one_variable_buckets(function, *args, **kwargs):
    """`function(*args, **kwargs)` with a bucket per variable."""
    from keras.src.backend.torch.distributed.training import gradients

    saved = gradients.FIRST_BUCKET_BYTES, gradients.BUCKET_BYTES
    # Below any variable's size, above the loss' (4 bytes): the loss
    # still shares the last bucket.
    gradients.FIRST_BUCKET_BYTES = gradients.BUCKET_BYTES = 5
    try:
        return function(*args, **kwargs)
    finally:
        gradients.FIRST_BUCKET_BYTES, gradients.BUCKET_BYTES = saved


def _fit_body(rank, world_size, kind):
    return _with_one_variable_buckets(pm.fit_run, kind, "dp")


def test_overlapped_buckets_train_like_one_process():
    """Losses, metrics, weights and optimizer state = one process'."""
    # A bucket per variable: all but the last launched during backward.
    per_rank = run_on_ranks(_fit_body, world_size=2, args=("attention",))
    reference = pm.run_single(pm.fit_run, "attention", "single")
    for rank, result in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
    pm.assert_ranks_agree(per_rank)


def _launch_order_body(rank, world_size):
    import numpy as np
    import torch
    import torch.distributed as dist

    import keras

    distributions.use_setting("dp")
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="fc1"),
            keras.layers.Dense(16, activation="relu", name="fc2"),
            keras.layers.Dense(4, name="fc3"),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.RandomState(0)
    x = rng.rand(8, 8).astype("float32")
    y = rng.rand(8, 4).astype("float32")
    # The first step's call is the probe's, through DTensor (see
    # `local_rows.call`); the second runs on the local rows. The buckets
    # are made in the first.
    _with_one_variable_buckets(model.train_on_batch, x, y)
    events = []
    backward = torch.Tensor.backward

    def recording_backward(tensor, *args, **kwargs):
        backward(tensor, *args, **kwargs)
        events.append("backward ends")

    all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        events.append(("all_reduce", bool(kwargs.get("async_op"))))
        return all_reduce(tensor, *args, **kwargs)

    from keras.src.backend.torch.distributed.training import step_reduction

    reduction = step_reduction.OverlappedReduction
    wait_all = reduction.wait_all

    def recording_wait_all(self, *args, **kwargs):
        if self.launched:
            events.append("launches waited for")
        return wait_all(self, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    torch.Tensor.backward = recording_backward
    reduction.wait_all = recording_wait_all
    try:
        loss = _with_one_variable_buckets(model.train_on_batch, x, y)
    finally:
        dist.all_reduce = all_reduce
        torch.Tensor.backward = backward
        reduction.wait_all = wait_all
        keras.distribution.set_distribution(None)
    return {"events": events, "loss": float(loss)}


def test_buckets_are_launched_during_the_backward_pass():
    results = run_on_ranks(_launch_order_body, world_size=2)
    assert results[0] == results[1]
    events = results[0]["events"]
    end = events.index("backward ends")
    # 6 variables, a bucket each: fc3's and fc2's 4 buckets and fc1's bias
    # are launched, asynchronously, before the backward pass ends; fc1's
    # kernel, the last bucket, after it, together with the loss, and
    # before waiting for the launched ones (in flight meanwhile).
    assert events[:end] == [("all_reduce", True)] * 5
    assert events[end + 1 :] == [("all_reduce", False), "launches waited for"]


def _reports_body(rank, world_size):
    """How many gradients reported their arrival to the step's reduction in
    a train step on the local rows, and the step's loss."""
    import numpy as np

    import keras
    from keras.src.backend.torch.distributed.training import step_reduction

    distributions.use_setting("dp")
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)]
    )
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.RandomState(0)
    x = rng.rand(8, 8).astype("float32")
    y = rng.rand(8, 4).astype("float32")
    _with_one_variable_buckets(model.train_on_batch, x, y)  # The probe's.
    reduction = step_reduction.OverlappedReduction
    gradient_ready, reports = reduction.gradient_ready, []

    def recording(self, *args, **kwargs):
        reports.append(args[0])
        return gradient_ready(self, *args, **kwargs)

    reduction.gradient_ready = recording
    try:
        loss = _with_one_variable_buckets(model.train_on_batch, x, y)
    finally:
        reduction.gradient_ready = gradient_ready
        keras.distribution.set_distribution(None)
    return {"reports": len(reports), "loss": float(loss)}


def test_only_a_mesh_of_processes_reports_arriving_gradients():
    # On one process a bucket has no axis to reduce over: no gradient hook
    # runs. On two, each of the 4 weights reports as it arrives but the
    # last bucket's (the first layer's kernel), reduced after backward.
    (alone,) = run_on_ranks(_reports_body, world_size=1)
    per_rank = run_on_ranks(_reports_body, world_size=2)
    assert alone["reports"] == 0, alone
    assert [r["reports"] for r in per_rank] == [3, 3], per_rank
    assert per_rank[0]["loss"] == per_rank[1]["loss"]


def _default_buckets_body(rank, world_size):
    """The all-reduces of a local-rows train step with the default bucket
    sizes on a CPU mesh, the arrivals reported, and the step's weights."""
    import numpy as np
    import torch.distributed as dist

    import keras
    from keras.src.backend.torch.distributed.training import step_reduction

    distributions.use_setting("dp")
    keras.utils.set_random_seed(1)
    # 1.6 MiB of float32 gradients: DDP's first bucket (1 MiB) would split
    # them in two.
    model = keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.RandomState(0)
    x = rng.rand(8, 256).astype("float32")
    y = rng.rand(8, 10).astype("float32")
    model.train_on_batch(x, y)  # The probe's.
    reduction = step_reduction.OverlappedReduction
    gradient_ready, all_reduce = reduction.gradient_ready, dist.all_reduce
    events = []

    def recording_ready(self, *args, **kwargs):
        events.append("arrived")
        return gradient_ready(self, *args, **kwargs)

    def recording_all_reduce(tensor, *args, **kwargs):
        events.append(("all_reduce", tensor.numel()))
        return all_reduce(tensor, *args, **kwargs)

    reduction.gradient_ready = recording_ready
    dist.all_reduce = recording_all_reduce
    try:
        model.train_on_batch(x, y)
    finally:
        reduction.gradient_ready, dist.all_reduce = gradient_ready, all_reduce
        keras.distribution.set_distribution(None)
    weights = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    return {"events": events, "weights": weights}


def test_a_cpu_mesh_reduces_the_gradients_below_a_bucket_at_once():
    # On CPUs gloo's all-reduce shares the cores with backward: no small
    # first bucket, so gradients below one bucket take one collective (with
    # the loss tracker's sum), after backward, and no arrival is reported.
    per_rank = run_on_ranks(_default_buckets_body, world_size=2)
    for result in per_rank:
        (event,) = result["events"]
        assert event[0] == "all_reduce", result
        # The gradients and the tracker's total, one number.
        assert event[1] == result["weights"] + 1, result


def test_the_first_bucket_is_small_on_an_accelerator_only():
    import types

    from keras.src.backend.torch.distributed.training import gradients

    cpu = types.SimpleNamespace(device_type="cpu")
    cuda = types.SimpleNamespace(device_type="cuda")
    assert gradients.first_bucket_bytes(cpu) == gradients.BUCKET_BYTES
    assert gradients.first_bucket_bytes(cuda) == gradients.FIRST_BUCKET_BYTES
    assert gradients.FIRST_BUCKET_BYTES < gradients.BUCKET_BYTES


def _shared_layer_run():
    """Three train steps of a model that calls one Dense layer twice: its
    weights accumulate two gradients in each backward pass."""
    import numpy as np

    import keras

    keras.utils.set_random_seed(3)
    inputs = keras.Input((8,))
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    x = shared(keras.layers.Dense(8, name="first")(inputs))
    outputs = keras.layers.Dense(3, name="head")(shared(x))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    rng = np.random.RandomState(0)
    x = rng.rand(8, 8).astype("float32")
    y = rng.rand(8, 3).astype("float32")
    losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
    return {
        "losses": losses,
        "weights": [np.asarray(w) for w in model.get_weights()],
    }


def _shared_layer_body(rank, world_size):
    distributions.use_setting("dp")
    return _with_one_variable_buckets(_shared_layer_run)


def test_a_weight_used_twice_is_reduced_with_both_gradients():
    # The shared layer's kernel and bias each complete their bucket at
    # their first gradient; the second, accumulated later in the same
    # backward pass, must reach the reduction too.
    per_rank = run_on_ranks(_shared_layer_body, world_size=2)
    reference = pm.run_single(_shared_layer_run)
    for rank, result in enumerate(per_rank):
        pm.assert_close(result, reference, f"rank {rank}")
    pm.assert_ranks_agree(per_rank)


def _uneven_buckets_body(rank, world_size):
    import types

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch.distributed.training import gradients
    from keras.src.backend.torch.distributed.training import step_reduction

    mesh = init_device_mesh("cpu", (world_size,))
    # Reversed: a small replicated weight, 3 rows of 2**17 floats (1.5 MiB)
    # sharded 2 / 1 rows, then 0.5 MiB replicated. By local bytes the first
    # 1 MiB bucket (a CPU mesh's first is as large as the others) would
    # close after the sharded weight on process 0 only.
    gradients.BUCKET_BYTES = 1024 * 1024
    values = (
        ("other", distribute_tensor(torch.zeros(2**17), mesh, [Replicate()])),
        ("sharded", distribute_tensor(torch.zeros(3, 2**17), mesh, [Shard(0)])),
        ("small", distribute_tensor(torch.zeros(8), mesh, [Replicate()])),
    )
    variables = [types.SimpleNamespace(name=n, value=v) for n, v in values]
    buckets = step_reduction._reverse_buckets(variables)
    return [[v.name for v in bucket] for bucket in buckets]


def test_buckets_are_the_same_on_every_process_of_uneven_shards():
    per_rank = run_on_ranks(_uneven_buckets_body, world_size=2)
    assert per_rank == [[["small", "sharded"], ["other"]]] * 2, per_rank
