"""Ops DTensor refuses are computed on global values (`fallback`).

Each body runs the same op on 2 gloo ranks under `dtensor_fallback()` and
returns global values, which the parent compares with the op computed on
plain tensors in one process. The op counts say which ops fell back.
"""

import math

import numpy as np
import torch

from tests.harness import run_on_ranks


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,))


def _fallback():
    from keras.src.backend.torch.distributed.dtensor_gaps import fallback
    from keras.src.backend.torch.distributed.dtensor_gaps import refused_on_rows

    fallback.reset_fallback_counts()
    # Each op meets its signature for the first time: on global values.
    refused_on_rows.forget()
    return fallback


def _pool_input():
    return (
        torch.arange(4 * 3 * 6 * 6, dtype=torch.float32)
        .reshape(4, 3, 6, 6)
        .sin()
    )


def _avg_pool_body(rank, world_size):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    fallback = _fallback()
    x = distribute_tensor(_pool_input(), _mesh(), [Shard(0)])
    x.requires_grad_()
    with fallback.dtensor_fallback():
        y = torch.nn.functional.avg_pool2d(x, 2)
        (y * y).sum().backward()
    counts = fallback.fallback_counts()
    return {
        "grad": x.grad.full_tensor().numpy(),
        "grad_placements": [str(p) for p in x.grad.placements],
        "counts": {k: (v.calls, v.gathered_bytes) for k, v in counts.items()},
    }


def test_op_without_a_strategy_in_the_backward_pass():
    x = _pool_input().requires_grad_()
    y = torch.nn.functional.avg_pool2d(x, 2)
    (y * y).sum().backward()
    per_rank = run_on_ranks(_avg_pool_body, world_size=2)
    for result in per_rank:
        np.testing.assert_allclose(result["grad"], x.grad.numpy(), rtol=1e-6)
        # Laid out again like the op's input: batch-sharded.
        assert result["grad_placements"] == ["S(0)"]
        calls, gathered = result["counts"]["aten.avg_pool2d_backward.default"]
        # Half of the input and of the output gradient came from the other
        # rank (4 bytes per float).
        assert calls == 1
        assert gathered == (x.numel() + y.numel()) // 2 * 4
    assert len(per_rank[0]["counts"]) == 1


def _unbind_body(rank, world_size):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    fallback = _fallback()
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    xd = distribute_tensor(x, _mesh(), [Shard(0)])
    with fallback.dtensor_fallback():
        rows = torch.unbind(xd, 0)
    return {
        "rows": [r.full_tensor().numpy() for r in rows],
        "counts": sorted(fallback.fallback_counts()),
    }


def test_refused_placement_unbind_along_the_sharded_dim():
    expected = torch.arange(24, dtype=torch.float32).reshape(4, 6).numpy()
    for result in run_on_ranks(_unbind_body, world_size=2):
        np.testing.assert_array_equal(np.stack(result["rows"]), expected)
        assert result["counts"] == ["aten.unbind.int"]


def _in_place_body(rank, world_size):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial

    fallback = _fallback()
    mesh = _mesh()
    # Each rank holds a share of [1, 2, 3] + [10, 20, 30].
    local = torch.tensor([1.0, 2.0, 3.0]) * (10.0 if rank else 1.0)
    partial = DTensor.from_local(local, mesh, [Partial("sum")])
    total = torch.zeros(3)
    with fallback.dtensor_fallback():
        partial.mul_(2.0)
        # A plain (replicated) tensor updated with a DTensor, as Keras'
        # regularizers do (`regularization += ...`): once, not per rank.
        total += partial
    return {
        "partial": partial.full_tensor().numpy(),
        "placements": [str(p) for p in partial.placements],
        "total": total.numpy(),
        "total_is_plain": type(total) is torch.Tensor,
    }


def test_in_place_ops_keep_their_operand_and_its_layout():
    for result in run_on_ranks(_in_place_body, world_size=2):
        np.testing.assert_allclose(result["partial"], [22.0, 44.0, 66.0])
        assert result["placements"] == ["P(sum)"]
        np.testing.assert_allclose(result["total"], [22.0, 44.0, 66.0])
        assert result["total_is_plain"]


def _local_layout_view_body(rank, world_size):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate

    fallback = _fallback()
    # A replicated DTensor whose global stride allows the view, holding a
    # local tensor laid out otherwise (as DTensor left Gemma's attention
    # output under ModelParallel): DTensor views the local tensor, and
    # refuses.
    value = torch.arange(4 * 8 * 8, dtype=torch.float32).reshape(4, 8, 8)
    local = value.transpose(1, 2).contiguous().transpose(1, 2)
    local = local.reshape(4, 8, 1, 1, 8)
    x = DTensor.from_local(
        local,
        _mesh(),
        [Replicate()],
        shape=local.shape,
        stride=(64, 8, 1, 8, 1),
        run_check=False,
    )
    with fallback.dtensor_fallback():
        y = x.view(32, 8)
    return {
        "y": y.full_tensor().numpy(),
        "counts": sorted(fallback.fallback_counts()),
    }


def test_a_view_of_a_local_tensor_laid_out_otherwise_than_its_dtensor():
    """A view DTensor refuses on its local tensor is one process' view."""
    expected = torch.arange(4 * 8 * 8, dtype=torch.float32).reshape(32, 8)
    for result in run_on_ranks(_local_layout_view_body, world_size=2):
        np.testing.assert_array_equal(result["y"], expected.numpy())
        assert result["counts"] == ["aten.view.default"]


def _computable_body(rank, world_size):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    fallback = _fallback()
    mesh = _mesh()
    a = distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])
    b = distribute_tensor(torch.ones(6, 2), mesh, [Replicate()])
    with fallback.dtensor_fallback():
        c = (a @ b).relu().sum()
    return float(c.full_tensor()), fallback.fallback_counts()


def test_nothing_falls_back_where_dtensor_computes():
    for value, counts in run_on_ranks(_computable_body, world_size=2):
        assert value == 48.0
        assert counts == {}


def _own_error_body(rank, world_size):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    fallback = _fallback()
    x = distribute_tensor(torch.ones(4, 4), _mesh(), [Shard(0)])
    try:
        with fallback.dtensor_fallback():
            torch.diagonal(x, dim1=0, dim2=0)
    except RuntimeError as e:
        return type(e.__cause__).__name__, str(e)
    return None


def test_an_op_that_fails_on_plain_tensors_raises_its_own_error():
    for result in run_on_ranks(_own_error_body, world_size=2):
        assert result is not None
        cause, message = result
        # torch's own message, with DTensor's refusal as its cause, on
        # every rank (no rank waits for the others in a gather).
        assert "diagonal dimensions cannot be identical" in message
        assert cause in ("NotImplementedError", "RuntimeError")


def _signal(shape):
    return (
        torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).sin()
    )


def _stft_body(rank, world_size):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    fallback = _fallback()
    x = distribute_tensor(_signal((2, 32)), _mesh(), [Shard(1)])
    x.requires_grad_()
    with fallback.dtensor_fallback():
        y = torch.stft(x, 8, window=torch.ones(8), return_complex=True)
        y.abs().sum().backward()
    return {
        "y": y.full_tensor().detach().numpy(),
        "grad": x.grad.full_tensor().numpy(),
        "counts": {k: v.calls for k, v in fallback.fallback_counts().items()},
    }


def test_a_function_that_reshapes_a_tensor_in_place_falls_back_whole():
    # torch.stft decomposes into `as_strided` and `transpose_`: no DTensor
    # takes a shape change in place, so stft runs again on global values.
    x = _signal((2, 32)).requires_grad_()
    y = torch.stft(x, 8, window=torch.ones(8), return_complex=True)
    y.abs().sum().backward()
    for result in run_on_ranks(_stft_body, world_size=2):
        np.testing.assert_allclose(result["y"], y.detach().numpy(), atol=1e-5)
        np.testing.assert_allclose(result["grad"], x.grad.numpy(), atol=1e-5)
        assert result["counts"]["torch.stft"] == 1


def _strided_view_body(rank, world_size):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate

    fallback = _fallback()
    # A replicated value whose local tensor is transposed in memory (a
    # gradient of a permute): one process' tensor of that value is
    # contiguous and takes any view.
    local = torch.arange(24, dtype=torch.float32).reshape(6, 4).t()
    x = DTensor.from_local(local, _mesh(), [Replicate()])
    with fallback.dtensor_fallback():
        y = x.view(24)
    return y.full_tensor().numpy(), sorted(fallback.fallback_counts())


def test_a_view_of_a_value_laid_out_in_another_order():
    expected = torch.arange(24, dtype=torch.float32).reshape(6, 4).t()
    for value, counts in run_on_ranks(_strided_view_body, world_size=2):
        np.testing.assert_array_equal(value, expected.reshape(24).numpy())
        assert counts == ["aten.view.default"]


def _memory_order_body(rank, world_size):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard

    strides_seen = []

    # An op DTensor has no strategy for, which reads its operand's memory
    # as laid out (cuDNN's RNN backward reads the forward's output so).
    @torch.library.custom_op("keras_test::read_memory", mutates_args=())
    def read_memory(x: torch.Tensor) -> torch.Tensor:
        strides_seen.append(x.stride())
        flat = torch.as_strided(x, (x.numel(),), (1,))
        return flat.clone()

    fallback = _fallback()
    # cuDNN's batch-first output: a (batch, time, features) view of a
    # time-major buffer, its rows sharded over the batch.
    value = torch.arange(24, dtype=torch.float32).reshape(3, 4, 2)
    value = value.transpose(0, 1)
    x = DTensor.from_local(value[2 * rank : 2 * rank + 2], _mesh(), [Shard(0)])
    with fallback.dtensor_fallback():
        memory = torch.ops.keras_test.read_memory(x)
    return {
        "strides": strides_seen,
        "memory": memory.full_tensor().numpy(),
        "counts": sorted(fallback.fallback_counts()),
    }


def test_a_global_value_is_laid_out_in_memory_as_one_process_tensor():
    value = torch.arange(24, dtype=torch.float32).reshape(3, 4, 2)
    one_process = value.transpose(0, 1)
    for result in run_on_ranks(_memory_order_body, world_size=2):
        # On global values, then checked on the local rows
        # (`refused_on_rows`), where its result is not rows.
        assert len(result["strides"]) == 2
        assert result["strides"][0] == one_process.stride()
        np.testing.assert_array_equal(result["memory"], value.reshape(-1))
        assert result["counts"] == ["keras_test.read_memory.default"]


def _heads():
    return torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3).cos()


def _strided_shard_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    fallback = _fallback()
    # (batch, heads, dim) with the heads sharded over the second axis of a
    # 2-D mesh, as an attention layer's heads are under `ModelParallel`.
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("batch", "model"))
    x = distribute_tensor(_heads(), mesh, [Replicate(), Shard(1)])
    x.requires_grad_()
    # Merged into an unsharded outer dimension: a strided shard.
    without_mode = x.detach().reshape(8, 3)
    with fallback.dtensor_fallback():
        merged = x.reshape(8, 3)
        y = merged @ merged.t()
        (y * y).sum().backward()
    return {
        "without_mode": [str(p) for p in without_mode.placements],
        "merged": [str(p) for p in merged.placements],
        "y": y.full_tensor().detach().numpy(),
        "grad": x.grad.full_tensor().numpy(),
        "counts": {
            k: (v.calls, v.gathered_bytes)
            for k, v in fallback.fallback_counts().items()
        },
    }


def test_a_strided_shard_is_gathered_along_its_mesh_axis():
    x = _heads().requires_grad_()
    merged = x.reshape(8, 3)
    y = merged @ merged.t()
    (y * y).sum().backward()
    for result in run_on_ranks(_strided_shard_body, world_size=2):
        # DTensor's own result is neither sharded nor replicated ...
        assert result["without_mode"][0] == "R"
        assert result["without_mode"][1] not in ("R", "S(0)", "S(1)")
        # ... and, under the mode, gathered along the "model" axis.
        assert result["merged"] == ["R", "R"]
        np.testing.assert_allclose(result["y"], y.detach().numpy(), rtol=1e-6)
        np.testing.assert_allclose(result["grad"], x.grad.numpy(), rtol=1e-6)
        strided = {
            name: count
            for name, count in result["counts"].items()
            if name.endswith("(strided shard)")
        }
        # The forward view, counted with the half of it the other rank held.
        assert sum(calls for calls, _ in strided.values()) >= 1
        assert any(
            gathered == 8 * 3 * 4 // 2 for _, gathered in strided.values()
        )


def _numbers_body(rank, world_size):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    fallback = _fallback()
    x = distribute_tensor(
        torch.arange(10, dtype=torch.float32).reshape(10, 1),
        _mesh(),
        [Shard(0)],
    )
    # One element, sharded: the second process holds nothing of it.
    one = distribute_tensor(torch.tensor([7.0]), _mesh(), [Shard(0)])
    without_mode = x.max().item()
    with fallback.dtensor_fallback():
        numbers = {
            "max": x.max().item(),
            "sum": float(x.sum()),
            "positive": bool(x.min() > 0),
            "argmax": int(x.argmax()),
            "one": one.item(),
        }
    return without_mode, numbers, sorted(fallback.fallback_counts())


def test_numbers_read_from_a_dtensor_are_its_global_value():
    per_rank = run_on_ranks(_numbers_body, world_size=2)
    # DTensor alone reads each process' part of the maximum (a partial).
    assert [without_mode for without_mode, _, _ in per_rank] == [4.0, 9.0]
    for _, numbers, counts in per_rank:
        assert numbers == {
            "max": 9.0,
            "sum": 45.0,
            "positive": False,
            "argmax": 9,
            "one": 7.0,
        }
        # `argmax` over the sharded rows too (see the test below).
        assert counts == [
            "aten._local_scalar_dense.default",
            "aten.argmax.default",
        ]


def _logits():
    return torch.arange(4 * 3 * 6, dtype=torch.float32).reshape(4, 3, 6).sin()


def _argmax_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    fallback = _fallback()
    # The vocabulary of the logits sharded, as a 2x2 layout's embedding
    # leaves them (keras-hub's accuracy metric takes their argmax).
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("batch", "model"))
    x = distribute_tensor(_logits(), mesh, [Shard(2), Replicate()])
    # Ties and NaNs across the shards; rows also sharded, unevenly.
    special = distribute_tensor(_special_logits(), mesh, [Shard(1), Shard(0)])
    with fallback.dtensor_fallback():
        positions = {
            "argmax": x.argmax(-1),
            "argmin": x.argmin(2),
            "argmax_kept": x.argmax(-1, keepdim=True),
            "argmax_all": x.argmax(),
            # Along a dimension that is not sharded: DTensor computes it.
            "argmax_rows": x.argmax(0),
            "special_argmax": special.argmax(1),
            "special_argmin": special.argmin(1),
        }
    return (
        {k: v.full_tensor().numpy() for k, v in positions.items()},
        {
            k: (v.calls, v.gathered_bytes)
            for k, v in fallback.fallback_counts().items()
        },
    )


def _special_logits():
    x = torch.zeros(3, 8)
    x[1, 5] = float("nan")  # in the second half of the sharded dimension
    x[2, 2] = x[2, 6] = 1.0  # equal maxima in both halves
    x[2, 1] = x[2, 7] = -1.0  # equal minima in both halves
    return x


def test_positions_over_a_sharded_dimension_are_global_positions():
    x = _logits()
    special = _special_logits()
    expected = {
        "argmax": x.argmax(-1),
        "argmin": x.argmin(2),
        "argmax_kept": x.argmax(-1, keepdim=True),
        "argmax_all": x.argmax(),
        "argmax_rows": x.argmax(0),
        "special_argmax": special.argmax(1),
        "special_argmin": special.argmin(1),
    }
    for positions, counts in run_on_ranks(_argmax_body, world_size=4):
        for name, value in expected.items():
            np.testing.assert_array_equal(
                positions[name], value.numpy(), err_msg=name
            )
        # Over a sharded dimension each process sends its shard's best
        # (`sharded_positions`); with no dimension, the global value is
        # gathered: the other half of the tensor.
        assert counts == {"aten.argmax.default": (1, x.numel() // 2 * 4)}


def _keras_summary_body(rank, world_size):
    import keras
    from keras.src.backend.torch.distributed.dtensor_gaps import fallback

    fallback.reset_fallback_counts()
    # Model parallel: under DataParallel this model runs on the local rows.
    mesh = keras.distribution.DeviceMesh(
        (1, 2), ["batch", "model"], keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense/kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            # A layer with weights first: pooling gets a backward pass.
            keras.layers.Dense(2, name="dense"),
            keras.layers.AveragePooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(1, name="head"),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 6, 6, 2), "float32")
    model.fit(x, np.ones((8, 1), "float32"), batch_size=8, verbose=0)
    lines = []
    keras.distribution.sharding_summary(model, print_fn=lines.append)
    return lines[0]


def test_sharding_summary_lists_the_ops_that_fell_back():
    text = run_on_ranks(_keras_summary_body, world_size=2)[0]
    assert "ops computed on global values" in text
    assert "aten.avg_pool2d_backward.default: 1 calls" in text


def _gather_at_once_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from keras.src.backend.torch.distributed.dtensor_gaps import global_values

    class Collectives(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                if "wait" not in func._opname:
                    Collectives.count += 1
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("batch", "model"))
    cases = {
        # Uneven parts on both axes: (3, 2) and (2, 1) rows and columns.
        "rows_and_columns": ((5, 3), [Shard(0), Shard(1)]),
        "columns_and_rows": ((3, 5), [Shard(1), Shard(0)]),
        # One dimension split twice: the parts nest (7 -> 4, 3 -> 2, 2, 2, 1).
        "nested": ((7, 2), [Shard(0), Shard(0)]),
        "negative_dim": ((4, 3, 6), [Shard(-1), Shard(0)]),
        # Not for one all-gather: DTensor's own gathers.
        "one_axis": ((4, 3), [Shard(0), Replicate()]),
        "partial": ((4, 3), [Partial(), Shard(0)]),
    }
    results = {}
    for name, (shape, placements) in cases.items():
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(
            shape
        )
        if name == "partial":
            # Each process along the batch axis holds half of the sum.
            half = distribute_tensor(full / 2, mesh, [Replicate(), Shard(0)])
            x = DTensor.from_local(
                half.to_local(), mesh, placements, run_check=False
            )
        else:
            x = distribute_tensor(full, mesh, placements)
        Collectives.count = 0
        with Collectives():
            whole = global_values.gathered_at_once(x)
        results[name] = (
            None if whole is None else whole.numpy(),
            x.full_tensor().numpy(),
            Collectives.count,
        )
    return results


def test_a_value_sharded_along_two_mesh_axes_is_gathered_at_once():
    per_rank = run_on_ranks(_gather_at_once_body, world_size=4)
    for results in per_rank:
        for name, (whole, expected, collectives) in results.items():
            if name in ("one_axis", "partial"):
                assert whole is None, name
                assert collectives == 0, name
                continue
            np.testing.assert_array_equal(whole, expected, err_msg=name)
            assert collectives == 1, (name, collectives)


def _out_of_memory_body(rank, world_size):
    """An op DTensor computes, whose kernel runs out of memory."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.experimental import register_sharding

    @torch.library.custom_op("keras_test::out_of_memory", mutates_args=())
    def out_of_memory(x: torch.Tensor) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("allocation of 1 TiB failed")

    # DTensor's sharding propagation runs the op on fake tensors.
    out_of_memory.register_fake(torch.empty_like)

    @register_sharding(torch.ops.keras_test.out_of_memory.default)
    def _(x):
        return [([Shard(0)], [Shard(0)])]

    from torch.distributed.tensor.debug import CommDebugMode

    fallback = _fallback()
    x = distribute_tensor(_pool_input(), _mesh(), [Shard(0)])
    try:
        with CommDebugMode() as comms, fallback.dtensor_fallback():
            torch.ops.keras_test.out_of_memory(x)
    except torch.cuda.OutOfMemoryError as error:
        raised = str(error)
    return raised, comms.get_total_counts()


def test_an_out_of_memory_error_is_not_retried_on_global_values():
    # Retrying on global values would gather the operand on every process
    # (more memory, where memory just ran out), then fail again.
    for raised, collectives in run_on_ranks(_out_of_memory_body, world_size=2):
        assert "allocation of 1 TiB failed" in raised
        assert collectives == 0


def test_only_dtensors_own_assertions_are_refusals():
    from keras.src.backend.torch.distributed.dtensor_gaps import fallback

    def raised(code, filename):
        try:
            exec(compile(code, filename, "exec"), {})
        except Exception as error:
            return error
        raise AssertionError(f"{code!r} raised nothing")

    dtensor_file = "/site-packages/torch/distributed/tensor/_sharding_prop.py"
    assert fallback.is_refusal(raised("assert False", dtensor_file))
    assert not fallback.is_refusal(raised("assert False", "/home/me/layer.py"))
    assert fallback.is_refusal(raised("raise NotImplementedError", "x.py"))
    assert not fallback.is_refusal(
        raised("import torch; raise torch.cuda.OutOfMemoryError()", "x.py")
    )
    # The CPU allocator's own error, raised by a real allocation.
    assert not fallback.is_refusal(
        raised("import torch; torch.empty(2**50)", "x.py")
    )


def test_an_error_chain_that_is_a_cycle_is_read_once():
    # An error object raised twice (a layer re-raising a stored error) makes
    # its chain a cycle, which the out-of-memory check must not follow
    # forever.
    from keras.src.backend.torch.distributed.dtensor_gaps import fallback

    first, second = ValueError("first"), RuntimeError("second")
    first.__context__, second.__cause__ = second, first
    assert not fallback.is_out_of_memory(first)
    assert fallback.is_refusal(first)
    oom = RuntimeError("DefaultCPUAllocator: can't allocate memory")
    first.__context__, oom.__cause__ = oom, first
    assert fallback.is_out_of_memory(first)
