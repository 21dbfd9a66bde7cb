"""Collectives of one training step, counted with `CommDebugMode`.

Each distributed training step should issue the collectives Megatron-style
tensor parallelism and DDP-style data parallelism issue, and no more: one
all-reduce per row-parallel layer in the forward pass, one per replicated
activation whose gradient comes back as a partial sum from column-parallel
layers in the backward pass, one per gradient bucket of replicated weights,
and none in the optimizer update (but one all-gather for a gradient sharded
otherwise than its weight). Counts are exact: a change that adds a
redistribution shows up here before it shows up in a benchmark.
"""

import numpy as np

from tests import distributions
from tests.harness import run_on_ranks

DIM, HIDDEN, BATCH = 8, 16, 8
# Megatron: fc1 column-parallel, fc2 row-parallel.
LAYOUT_RULES = {
    "fc1/kernel": (None, "model"),
    "fc1/bias": ("model",),
    "fc2/kernel": ("model", None),
}


def _model(kind):
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((DIM,))
    x = inputs
    if kind == "block":
        x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Dense(HIDDEN, activation="relu", name="fc1")(x)
    x = keras.layers.Dense(DIM, name="fc2")(x)
    if kind == "block":
        x = keras.layers.Add()([inputs, x])
    return keras.Model(inputs, x)


def _step_collectives_body(rank, world_size, setting, kind):
    from torch.distributed.tensor.debug import CommDebugMode

    import keras
    from keras.src.backend.torch import distribution_lib
    from keras.src.backend.torch.distributed.training.step import running_step

    distributions.use_setting(setting, layout_rules=LAYOUT_RULES)
    model = _model(kind)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    rng = np.random.RandomState(0)
    x = rng.rand(BATCH, DIM).astype("float32")
    y = rng.rand(BATCH, DIM).astype("float32")
    model.train_on_batch(x, y)  # Builds the optimizer.
    # A step, with the gradients its reduction takes and gives.
    weights = model.trainable_weights
    taken, given = {}, []
    reduce_gradients = distribution_lib.reduce_gradients

    def recording_reduce_gradients(model, gradients):
        # Under data parallelism the weights enter as plain leaves, whose
        # gradients are each process' partial sums (see `local_leaf`).
        reduction = running_step(model)._reduction
        leaves = {} if reduction is None else reduction.leaf_of
        for w, g in zip(weights, gradients):
            leaf = leaves.get(id(w))
            if leaf is not None:
                taken[w.path] = ("leaf", float(leaf.grad.sum()))
            else:
                partial = any(p.is_partial() for p in g.placements)
                taken[w.path] = ("dtensor", partial)
        result = reduce_gradients(model, gradients)
        given.extend(result)
        return result

    distribution_lib.reduce_gradients = recording_reduce_gradients
    try:
        model.train_on_batch(x, y)
    finally:
        distribution_lib.reduce_gradients = reduce_gradients
    reduced, given = given, [float(_local_sum(g)) for g in given]
    with CommDebugMode() as step:
        model.train_on_batch(x, y)
    # The update alone, on reduced gradients.
    with CommDebugMode() as update:
        model.optimizer.apply(reduced, weights)
    keras.distribution.set_distribution(None)
    return {
        "step": {str(k): v for k, v in step.get_comm_counts().items()},
        "update": update.get_total_counts(),
        "taken": taken,
        "given": given,
    }


def _local_sum(x):
    return (x.to_local() if hasattr(x, "to_local") else x).sum()


def _counts(setting, kind):
    results = run_on_ranks(
        _step_collectives_body, world_size=2, args=(setting, kind)
    )
    taken = [r.pop("taken") for r in results]
    given = [r.pop("given") for r in results]
    assert results[0] == results[1]
    return {**results[0], "taken": taken, "given": given}


def _partial_gradients(taken):
    """Paths of the weights whose gradient the reduction took partial."""
    return sorted(
        path for path, (kind, value) in taken.items() if kind == "leaf" or value
    )


def test_model_parallel_mlp_step_all_reduces_once():
    # fc2's output, forward; fc1's input is data: no backward collective.
    counts = _counts("mp", "mlp")
    assert counts["step"] == {"c10d_functional.all_reduce": 1}
    assert counts["update"] == 0
    # The batch axis of the (1, 2) mesh splits nothing: the batch is laid
    # out replicated, so no gradient is a partial sum over it.
    assert _partial_gradients(counts["taken"][0]) == []


def test_model_parallel_block_all_reduces_once_each_way():
    # Forward: fc2's output. Backward: the gradient of the LayerNorm output,
    # a partial sum from column-parallel fc1, once; the LayerNorm weights'
    # gradients are then whole and need no reduction.
    counts = _counts("mp", "block")
    assert counts["step"] == {"c10d_functional.all_reduce": 2}
    assert counts["update"] == 0
    assert _partial_gradients(counts["taken"][0]) == []


def test_data_parallel_step_reduces_the_loss_in_the_gradient_bucket():
    # One collective: the gradient bucket (all weights are far below
    # 25 MiB), which also carries the loss Keras reports (the global
    # batch's, which DDP does not compute): the loss tracker takes it as a
    # partial sum before the backward pass, and its total is written whole
    # once reduced with the bucket.
    counts = _counts("dp", "block")
    assert counts["step"] == {"c10d.allreduce_": 1}
    assert counts["update"] == 0
    # Each weight's gradient is a sum over the batch parts, taken as a plain
    # leaf's gradient (each process' part), reduced in the bucket.
    assert _partial_gradients(counts["taken"][0]) == [
        "fc1/bias",
        "fc1/kernel",
        "fc2/bias",
        "fc2/kernel",
        "norm/beta",
        "norm/gamma",
    ]
    # The parts differ from process to process; the reduced sums agree.
    rank0, rank1 = counts["taken"]
    assert all(rank0[path] != rank1[path] for path in rank0)
    assert counts["given"][0] == counts["given"][1]


def _divide_no_nan_body(rank, world_size):
    import torch
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.debug import CommDebugMode

    import keras
    from keras.src.backend.torch.distributed.core import layouts

    distributions.use_setting("dp")
    mesh = layouts.as_torch_layout(
        keras.distribution.distribution().get_data_layout((2,))
    ).device_mesh
    # Process r holds r + 1: the value is 1 + 2 = 3.
    local = torch.tensor(float(rank + 1))
    partial = layouts.dtensor_from_local(local, mesh, [Partial()], shape=())
    out = {}
    for name, divisor in (("by_2", 2.0), ("by_0", 0.0)):
        with CommDebugMode() as comm:
            quotient = keras.ops.divide_no_nan(partial, divisor)
        out[name] = {
            "partial": any(p.is_partial() for p in quotient.placements),
            "comms": comm.get_total_counts(),
            "value": float(quotient.full_tensor()),
        }
    keras.distribution.set_distribution(None)
    return out


def test_divide_no_nan_keeps_a_partial_loss_partial():
    # The loss over a sharded batch stays a partial sum through its
    # division by the sample count, to be reduced in the gradient bucket,
    # with no collective; a zero divisor gives 0 as upstream's `where` does.
    results = run_on_ranks(_divide_no_nan_body, world_size=2)
    assert results[0] == results[1]
    by_2, by_0 = results[0]["by_2"], results[0]["by_0"]
    assert by_2 == {"partial": True, "comms": 0, "value": 1.5}
    assert by_0 == {"partial": True, "comms": 0, "value": 0.0}


def _other_layout_update_body(rank, world_size):
    import torch
    import torch.distributed.tensor.placement_types as placement_types
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import keras

    distributions.use_setting("mp", layout_rules={"w": (None, "model")})
    results = {}
    for grad_dim in (1, 0):
        # A kernel sharded on its output features (dim 1) whose gradient
        # comes sharded on its input features (dim 0), or as the kernel.
        variable = keras.Variable(
            np.arange(32.0).reshape(4, 8), name="w", dtype="float32"
        )
        optimizer = keras.optimizers.Adam(0.1)
        optimizer.build([variable])
        mesh = variable.value.device_mesh
        gradient = distribute_tensor(
            torch.linspace(-1.0, 1.0, 32).reshape(4, 8),
            mesh,
            [Replicate(), Shard(grad_dim)],
        )
        shard_dim_alltoall = placement_types.shard_dim_alltoall
        fallbacks = []

        def counted(*args, **kwargs):
            fallbacks.append(1)
            return shard_dim_alltoall(*args, **kwargs)

        placement_types.shard_dim_alltoall = counted
        try:
            with CommDebugMode() as comm:
                optimizer.apply([gradient], [variable])
        finally:
            placement_types.shard_dim_alltoall = shard_dim_alltoall
        results[grad_dim] = {
            "comms": {str(k): v for k, v in comm.get_comm_counts().items()},
            "fallbacks": len(fallbacks),
            "placements": str(tuple(variable.value.placements)),
            "value": variable.numpy(),
        }
    keras.distribution.set_distribution(None)
    return results


def test_update_takes_a_gradient_sharded_otherwise_in_one_gather():
    # The gradient is laid out as its variable once, before the update
    # (an all-gather, then each process' chunk), not by each of Adam's ops
    # that read it: before, 3 Shard-to-Shard redistributions, each
    # DTensor's all-to-all fallback on CPU (an all-gather and a notice).
    for result in run_on_ranks(_other_layout_update_body, world_size=2):
        other, same = result[0], result[1]
        assert other["comms"] == {"c10d_functional.all_gather_into_tensor": 1}
        assert other["fallbacks"] == 0
        assert same["comms"] == {} and same["fallbacks"] == 0
        assert other["placements"] == same["placements"]
        np.testing.assert_array_equal(other["value"], same["value"])


def _all_to_all_notice_body(rank, world_size):
    import logging

    import torch
    from torch._logging import warning_once
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.device_mesh import init_device_mesh

    from keras.src.backend.torch.distributed.core import runtime

    logger = logging.getLogger("torch.distributed.tensor._collective_utils")
    (notice_filter,) = [
        f
        for f in logger.filters
        if isinstance(f, runtime._GatheredAllToAllFilter)
    ]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    mesh = init_device_mesh("cpu", (world_size,))
    x = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])
    messages = {}
    try:
        for filtered in (True, False):
            if not filtered:
                logger.removeFilter(notice_filter)
            warning_once.cache_clear()  # Logged once per process otherwise.
            records.clear()
            x.redistribute(mesh, [Shard(1)])
            logger.warning("another message")
            messages[filtered] = [r.getMessage() for r in records]
    finally:
        logger.removeHandler(handler)
        logger.addFilter(notice_filter)
    return messages


def test_dtensor_all_to_all_notice_is_dropped_and_only_it():
    # DTensor still logs exactly the notice the filter drops (on CPU it
    # gathers for an all-to-all, whatever the backend); other messages of
    # its logger pass.
    from keras.src.backend.torch.distributed.core import runtime

    for messages in run_on_ranks(_all_to_all_notice_body, world_size=2):
        assert messages[True] == ["another message"]
        assert messages[False] == [
            runtime.GATHERED_ALL_TO_ALL_NOTICE,
            "another message",
        ]


def _partial_values(mesh, layouts, factor):
    """DTensors of `layouts` (`(shape, placements)`), each process' part
    `arange * factor(index)`, sharded as the placements say."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate

    values = []
    for index, (shape, placements) in enumerate(layouts):
        numel = torch.Size(shape).numel()
        part = torch.arange(float(numel)).reshape(shape) * factor(index)
        whole = DTensor.from_local(
            part, mesh, [Replicate()] * mesh.ndim, run_check=False
        )
        # Each process keeps its shard of its part on the sharded axes.
        local = whole.redistribute(
            mesh, [p if p.is_shard() else Replicate() for p in placements]
        ).to_local()
        values.append(
            DTensor.from_local(
                local,
                mesh,
                placements,
                run_check=False,
                shape=shape,
                stride=whole.stride(),
            )
        )
    return values


def _reduced_as_dtensor_reduces(mesh, values):
    """Collectives of `reduce_gradients(values)`, the placements it gives
    and whether its values are DTensor's own reductions of them."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    from keras.src.backend.torch.distributed.training import gradients

    whole = [Replicate()] * mesh.ndim
    expected = [v.redistribute(mesh, whole).to_local() for v in values]
    with CommDebugMode() as comm:
        reduced = gradients.reduce_gradients(values)
    return {
        "comms": {str(k): v for k, v in comm.get_comm_counts().items()},
        "placements": [str(tuple(r.placements)) for r in reduced],
        "equal": [
            bool((r.redistribute(mesh, whole).to_local() == e).all())
            for r, e in zip(reduced, expected)
        ],
    }


def _mixed_layout_bucket_body(rank, world_size):
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("batch", "model"))
    batch = mesh.get_local_rank(0)
    # Partial sums over the batch axis, laid out four ways over the model
    # axis (a kernel's gradient sharded on either dimension, an uneven
    # one, a norm's replicated one), and an average: the parts differ
    # along the batch axis.
    over_batch = _partial_values(
        mesh,
        [
            ((4, 6), [Partial(), Shard(1)]),
            ((6, 4), [Partial(), Shard(0)]),
            ((5,), [Partial(), Shard(0)]),
            ((3,), [Partial(), Replicate()]),
            ((), [Partial("avg"), Replicate()]),
        ],
        lambda index: batch + 1 + index,
    )
    # Partial over both axes (a replicated weight's gradient through
    # model-sharded activations): every process' part differs.
    over_both = _partial_values(
        mesh,
        [((2, 3), [Partial(), Partial()]), ((), [Partial("avg")] * 2)],
        lambda index: rank + 1 + index,
    )
    return {
        "over_batch": _reduced_as_dtensor_reduces(mesh, over_batch),
        "over_both": _reduced_as_dtensor_reduces(mesh, over_both),
    }


def test_gradients_partial_over_the_same_axes_share_one_all_reduce():
    # Partial over the batch axis only: one all-reduce over it sums them
    # all, whatever their layout on the model axis (before: one per layout).
    # Partial over both axes of a mesh of every process: one all-reduce
    # over all of them (before: one per axis).
    for result in run_on_ranks(_mixed_layout_bucket_body, world_size=4):
        over_batch, over_both = result["over_batch"], result["over_both"]
        assert over_batch["comms"] == {"c10d.allreduce_": 1}, result
        assert over_batch["equal"] == [True] * 5, result
        assert over_batch["placements"] == [
            "(Replicate(), Shard(dim=1))",
            "(Replicate(), Shard(dim=0))",
            "(Replicate(), Shard(dim=0))",
            "(Replicate(), Replicate())",
            "(Replicate(), Replicate())",
        ], result
        assert over_both["comms"] == {"c10d.allreduce_": 1}, result
        assert over_both["equal"] == [True] * 2, result
        assert over_both["placements"] == ["(Replicate(), Replicate())"] * 2


def _equal_meshes_body(rank, world_size):
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.device_mesh import init_device_mesh

    # Two mesh objects of one value: DTensor's sharding propagation cache
    # hands out an earlier, equal mesh's object with its results.
    meshes = [init_device_mesh("cpu", (world_size,)) for _ in range(2)]
    assert meshes[0] is not meshes[1] and meshes[0] == meshes[1]
    values = [
        _partial_values(mesh, [((3, 2), [Partial()])], lambda _: rank + 1)[0]
        for mesh in meshes
    ]
    return _reduced_as_dtensor_reduces(meshes[0], values)


def test_gradients_on_equal_meshes_share_one_all_reduce():
    for result in run_on_ranks(_equal_meshes_body, world_size=2):
        assert result["comms"] == {"c10d.allreduce_": 1}, result
        assert result["equal"] == [True, True], result


def _gradient_sharded_by_a_consumer_body(rank, world_size):
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard

    import keras

    distributions.use_model_parallel(layout_rules={}, mesh_shape=(1, 2))
    rng = np.random.RandomState(0)
    x = rng.rand(4, 8).astype("float32")
    w = torch.tensor(rng.rand(4, 8).astype("float32"))

    class RowsShardedBackward(torch.autograd.Function):
        """Identity whose backward shards the gradient's rows over the
        model axis, as DTensor's backward of a scatter or an index does
        (a mixture of experts dispatching tokens)."""

        @staticmethod
        def forward(ctx, y):
            return y.view_as(y)

        @staticmethod
        def backward(ctx, grad):
            placements = list(grad.placements)
            placements[1] = Shard(0)
            return grad.redistribute(grad.device_mesh, placements)

    norm = keras.layers.LayerNormalization(name="norm")
    y = norm(x)
    (RowsShardedBackward.apply(y) * w).sum().backward()
    gamma_grad = norm.gamma.value.grad
    # The gradient of a layer normalization's scale, from plain torch.
    x = torch.tensor(x)
    mean = x.mean(-1, keepdim=True)
    variance = x.var(-1, unbiased=False, keepdim=True)
    expected = (w * (x - mean) / torch.sqrt(variance + norm.epsilon)).sum(0)
    keras.distribution.set_distribution(None)
    return {
        "placements": str(tuple(gamma_grad.placements)),
        "value": gamma_grad.full_tensor().numpy(),
        "expected": expected.numpy(),
        "is_dtensor": isinstance(gamma_grad, DTensor),
    }


def test_a_layer_computes_on_its_outputs_whole_gradient():
    # A consumer's backward left the gradient of the normalization's
    # replicated output sharded by rows over the model axis: it is made
    # whole as it reaches the layer (Megatron's `f`), so the scale's
    # gradient is whole too, instead of a partial sum over the model axis
    # for the step to all-reduce.
    for result in run_on_ranks(
        _gradient_sharded_by_a_consumer_body, world_size=2
    ):
        assert result["is_dtensor"], result
        assert "Partial" not in result["placements"], result
        np.testing.assert_allclose(
            result["value"], result["expected"], rtol=1e-5, atol=1e-6
        )


def _class_sharded_head_body(rank, world_size, loss_name):
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    import keras
    from keras.src.backend.torch.distributed.data_parallel import local_loss
    from keras.src.backend.torch.distributed.training import step

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, DIM)).astype("float32")
    labels = rng.integers(0, HIDDEN, size=(BATCH,))
    losses = {
        "crossentropy": (
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            labels,
        ),
        "mse": ("mse", np.eye(HIDDEN, dtype="float32")[labels]),
    }
    loss, y = losses[loss_name]
    results = {}
    for mode in ("gathered", "as_before"):
        if mode == "as_before":
            step.techniques.predictions = lambda model, y, y_pred: y_pred
        try:
            # A classifier head sharded over its classes (a vocabulary).
            distributions.use_setting(
                "mp",
                layout_rules={
                    "head/kernel": (None, "model"),
                    "head/bias": ("model",),
                },
            )
            keras.utils.set_random_seed(1)
            inputs = keras.Input((DIM,))
            hidden = keras.layers.Dense(DIM, name="body")(inputs)
            model = keras.Model(
                inputs, keras.layers.Dense(HIDDEN, name="head")(hidden)
            )
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=loss,
                metrics=["accuracy"],
            )
            model.train_on_batch(x, y)
            with CommDebugMode() as comm:
                logs = model.train_on_batch(x, y, return_dict=True)
            results[mode] = {
                "comms": comm.get_total_counts(),
                "ops": {str(k): v for k, v in comm.get_comm_counts().items()},
                "logs": logs,
                "weights": [w.numpy() for w in model.weights],
            }
        finally:
            step.techniques.predictions = local_loss.gathered_predictions
            keras.distribution.set_distribution(None)
    torch.distributed.barrier()
    return results


def test_class_sharded_logits_are_gathered_once_for_loss_and_metrics():
    # The softmax cross-entropy gathers the classes the head shards, and
    # the accuracy's argmax gathered them again: now one gather before
    # both, with the same numbers.
    for result in run_on_ranks(
        _class_sharded_head_body, world_size=2, args=("crossentropy",)
    ):
        gathered, before = result["gathered"], result["as_before"]
        assert gathered["comms"] == before["comms"] - 1, (
            gathered["ops"],
            before["ops"],
        )
        assert gathered["logs"] == before["logs"]
        for a, b in zip(gathered["weights"], before["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_class_sharded_outputs_of_other_losses_are_left_sharded():
    # Mean squared error reduces the classes in partial sums: no gather.
    for result in run_on_ranks(
        _class_sharded_head_body, world_size=2, args=("mse",)
    ):
        assert result["gathered"]["comms"] == result["as_before"]["comms"]


def _counted_steps_both_ways(
    build, module, name, replacement, modes, shape=(BATCH, DIM)
):
    """A model's counted step, as it is and with `module.<name>` replaced.

    Args:
        build: sets the distribution and returns a compiled model.
        module: the module whose attribute the second run replaces.
        name: the attribute.
        replacement: its value in the second run.
        modes: the names of the two runs' results.
        shape: the shape of the inputs and targets.

    Returns:
        `{mode: {"comms", "ops", "loss", "weights", "placements"}}`.
    """
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype("float32")
    y = rng.normal(size=shape).astype("float32")
    original = getattr(module, name)
    results = {}
    for mode in modes:
        if mode == modes[1]:
            setattr(module, name, replacement)
        try:
            keras.utils.set_random_seed(1)
            model = build()
            model.train_on_batch(x, y)
            with CommDebugMode() as comm:
                loss = model.train_on_batch(x, y)
            results[mode] = {
                "comms": comm.get_total_counts(),
                "ops": {str(k): v for k, v in comm.get_comm_counts().items()},
                "loss": float(loss),
                "weights": [w.numpy() for w in model.weights],
                "placements": {
                    w.path: str(getattr(w.value, "placements", None))
                    for w in model.weights
                },
            }
        finally:
            setattr(module, name, original)
            keras.distribution.set_distribution(None)
    torch.distributed.barrier()
    return results


def _assert_one_collective_fewer(fewer, more):
    assert fewer["comms"] == more["comms"] - 1, (fewer["ops"], more["ops"])
    np.testing.assert_allclose(fewer["loss"], more["loss"], rtol=1e-6)
    for a, b in zip(fewer["weights"], more["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _projections_model(key_in_block=False):
    """Two projections with replicated kernels beside a column layer, each
    read by a column layer (key/value heads beside split query heads):
    their output gradients are partial sums. With `key_in_block`, the key
    projection is called by a block with weights of its own, which returns
    the projection's output as it is."""
    import keras

    class Block(keras.layers.Layer):
        # Its own weight puts it among the layers that compute on their
        # whole output gradient.
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.key = keras.layers.Dense(DIM, name="k")
            self.steps = self.add_weight(
                shape=(), initializer="zeros", trainable=False, name="steps"
            )

        def call(self, x):
            return self.key(x)

    distributions.use_setting(
        "mp",
        layout_rules={
            f"{name}/kernel": axes
            for names, axes in (
                (("q", "k_up", "v_up"), (None, "model")),
                (("q_down", "k_down", "v_down"), ("model", None)),
            )
            for name in names
        },
    )
    inputs = keras.Input((DIM,))
    h = keras.layers.LayerNormalization(name="norm")(inputs)
    outputs = [inputs]
    for name, width in (("q", HIDDEN), ("k", DIM), ("v", DIM)):
        z = h
        if name == "k" and key_in_block:
            z = Block(name="block")(h)
        elif name != "q":
            z = keras.layers.Dense(width, name=name)(h)
        if name != "q":
            name = f"{name}_up"
        z = keras.layers.Dense(HIDDEN, "relu", name=name)(z)
        down = name.replace("_up", "") + "_down"
        outputs.append(keras.layers.Dense(DIM, name=down)(z))
    model = keras.Model(inputs, keras.layers.Add()(outputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _replicated_projections_body(rank, world_size):
    from keras.src.backend.torch.distributed.training import layer_call

    return _counted_steps_both_ways(
        _projections_model,
        layer_call,
        "_partial_gradient_axes",
        lambda *args: (),
        ("kept_partial", "as_before"),
    )


def test_replicated_projections_keep_partial_output_gradients():
    # The output gradients of the two replicated projections reach them as
    # partial sums; kept so, they join the query's at the normalization's
    # output (one all-reduce) and their kernels' gradients join the step's
    # reduction (one), where each projection all-reduced its own: one
    # collective fewer, the same numbers.
    for result in run_on_ranks(_replicated_projections_body, world_size=2):
        kept, before = result["kept_partial"], result["as_before"]
        k_kernel = kept["placements"]["k/kernel"]
        assert "Shard" not in k_kernel, k_kernel
        _assert_one_collective_fewer(kept, before)


def _merging_layer_body(rank, world_size):
    import keras
    from keras.src.backend.torch.distributed.training import layer_call

    def build():
        distributions.use_setting("mp", layout_rules=LAYOUT_RULES)
        inputs = keras.Input((DIM,))
        # Two normalizations (layers with weights: each computes on its
        # whole output gradient) merged by an `Add` (no weights, two
        # inputs) that a column-parallel layer reads.
        a = keras.layers.LayerNormalization(name="norm_a")(inputs)
        b = keras.layers.LayerNormalization(name="norm_b")(inputs)
        h = keras.layers.Add()([a, b])
        h = keras.layers.Dense(HIDDEN, "relu", name="fc1")(h)
        model = keras.Model(inputs, keras.layers.Dense(DIM, name="fc2")(h))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    return _counted_steps_both_ways(
        build,
        layer_call,
        "_differentiated_inputs",
        lambda inputs: 1,
        ("merged_once", "handed_on"),
    )


def test_a_layer_merging_inputs_reduces_its_partial_gradient_once():
    # Handed on through the `Add`, the partial gradient would reach both
    # normalizations, and each would all-reduce it.
    for result in run_on_ranks(_merging_layer_body, world_size=2):
        _assert_one_collective_fewer(result["merged_once"], result["handed_on"])


def _inner_output_body(rank, world_size):
    from keras.src.backend.torch.distributed.training import layer_call

    return _counted_steps_both_ways(
        lambda: _projections_model(key_in_block=True),
        layer_call,
        "_hooked_by_inner_layer",
        lambda output: False,
        ("inner_layer_decides", "outer_hook_too"),
    )


def test_an_inner_layers_output_returned_as_is_keeps_its_gradient_rule():
    # The key projection keeps its partial output gradient; the block that
    # returns its output as it is (a mixture-of-experts block returning its
    # router's logits) would make it whole again with a hook of its own.
    for result in run_on_ranks(_inner_output_body, world_size=2):
        kept = result["inner_layer_decides"]
        _assert_one_collective_fewer(kept, result["outer_hook_too"])
        assert "Shard" not in kept["placements"]["block/k/kernel"]


def _indivisible_heads_body(rank, world_size):
    import keras
    from keras.src.distribution import auto_plan

    def build():
        keras.distribution.set_distribution(
            keras.distribution.AutoModelParallel()
        )
        inputs = keras.Input((4, DIM))
        h = keras.layers.LayerNormalization(name="norm")(inputs)
        # Two heads on four processes: none can be split head-parallel.
        h = keras.layers.MultiHeadAttention(2, DIM, name="mha")(h, h)
        model = keras.Model(inputs, keras.layers.Add()([inputs, h]))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    return _counted_steps_both_ways(
        build,
        auto_plan.Plan,
        "_gathers_blocks",
        lambda self, parent: False,
        ("gathered", "row_parallel"),
        shape=(BATCH, 4, DIM),
    )


def test_a_block_with_heads_the_model_axis_does_not_divide_is_gathered():
    # Its kernels stay sharded in storage and are gathered once for the
    # block's call: one collective, where splitting their input features
    # all-reduced the query, key, value and output projections forward
    # and gathered two input gradients backward. The same numbers.
    for result in run_on_ranks(_indivisible_heads_body, world_size=4):
        gathered, row = result["gathered"], result["row_parallel"]
        assert gathered["comms"] == 1, gathered["ops"]
        assert row["comms"] == 6, row["ops"]
        for path in ("mha/query/kernel", "mha/attention_output/kernel"):
            assert "Shard" in gathered["placements"][path]
            assert gathered["placements"][path] == row["placements"][path]
        np.testing.assert_allclose(gathered["loss"], row["loss"], rtol=1e-6)
        for a, b in zip(gathered["weights"], row["weights"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _partial_metric_update_body(rank, world_size):
    import torch
    from torch.distributed.tensor import Partial

    import keras
    from keras.src.backend.torch.distributed.core import layouts
    from keras.src.backend.torch.distributed.core import local_state
    from keras.src.backend.torch.distributed.training import layer_call

    distributions.use_setting("dp")
    mesh = layouts.as_torch_layout(
        keras.distribution.distribution().get_data_layout((2,))
    ).device_mesh
    # Process r holds r + 1 of the loss: the loss is 1 + 2 = 3.
    loss = layouts.dtensor_from_local(
        torch.tensor(float(rank + 1)), mesh, [Partial()], shape=()
    )
    tracker = keras.metrics.Mean()
    with layer_call.replicated_plain_tensors():
        with local_state.local_metric_state(tracker):
            tracker.update_state(loss, sample_weight=4)
    values = [float(v.value.to_local()) for v in tracker.variables]
    keras.distribution.set_distribution(None)
    return values


def test_a_partial_loss_updates_the_tracker_with_its_whole_value():
    # The tracker's replicated state runs on local tensors; the partial
    # loss that meets it is reduced before it is written back, not
    # written as this process' share.
    results = run_on_ranks(_partial_metric_update_body, world_size=2)
    assert results == [[12.0, 4.0], [12.0, 4.0]]


def _deferred_tracker_update_body(rank, world_size):
    import torch
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.debug import CommDebugMode

    import keras
    from keras.src.backend.torch.distributed.core import layouts
    from keras.src.backend.torch.distributed.core import local_state

    distributions.use_setting("dp")
    mesh = layouts.as_torch_layout(
        keras.distribution.distribution().get_data_layout((2,))
    ).device_mesh
    tracker = keras.metrics.Mean()
    # A tracker part way through an epoch: 7 over 3 rows.
    tracker.total.assign(7.0)
    tracker.count.assign(3.0)
    # Process r holds r + 1 of the loss: the loss is 1 + 2 = 3.
    loss = layouts.dtensor_from_local(
        torch.tensor(float(rank + 1)), mesh, [Partial()], shape=()
    )
    deferred = []

    def defer(local, value, over):
        # As the step's last bucket would: this process' term summed over
        # the mesh, then copied in.
        deferred.append((type(value).__name__, over == mesh))
        total = value.clone()
        torch.distributed.all_reduce(total)
        local.copy_(total)
        return True

    with CommDebugMode() as comm:
        with local_state.local_metric_state(tracker, defer, loss) as value:
            read = type(value).__name__
            tracker.update_state(value, sample_weight=4)
            collectives = comm.get_total_counts()
    values = [float(v.value.to_local()) for v in tracker.variables]
    keras.distribution.set_distribution(None)
    return values, read, collectives, deferred


def test_a_deferred_tracker_update_reads_the_local_loss():
    # Keras' train step's tracker update: the loss' local term read with no
    # DTensor op nor collective; the total deferred as this process' plain
    # term of a sum over the data mesh (7 + 3 * 4 = 19 once summed), the
    # count (3 + 4, the same on every process) written back, not summed.
    results = run_on_ranks(_deferred_tracker_update_body, world_size=2)
    expected = ([19.0, 7.0], "Tensor", 0, [("Tensor", True)])
    assert results == [expected, expected]


def _tracker_result_body(rank, world_size):
    import torch
    from torch.distributed.tensor import DTensor

    import keras

    distributions.use_setting("dp")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    read = []
    mean_result = keras.metrics.Mean.result

    def result(metric):
        read.append(type(metric.total.value).__name__)
        return mean_result(metric)

    keras.metrics.Mean.result = result
    try:
        x = np.arange(32, dtype="float32").reshape(8, 4) / 32
        y = np.ones((8, 2), "float32")
        logs = model.train_on_batch(x, y, return_dict=True)
    finally:
        keras.metrics.Mean.result = mean_result
    restored = [
        isinstance(v.value, DTensor) for v in model.metrics[0].variables
    ]
    keras.distribution.set_distribution(None)
    return read, restored, torch.is_tensor(logs["loss"]), float(logs["loss"])


def test_the_steps_results_read_the_tracker_on_its_local_values():
    # The loss tracker's result in Keras' train step reads plain tensors
    # (no DTensor op), whose variables hold their DTensors again after it.
    results = run_on_ranks(_tracker_result_body, world_size=2)
    for read, restored, _, loss in results:
        assert read == ["Tensor"], read
        assert restored == [True, True], restored
        assert loss == results[0][3]
