"""Ops DTensor refuses, on each process' rows where they are per-sample.

The first time an op meets a signature it is computed on global values
and checked on the local rows (`refused_on_rows`); from then on a
per-sample op gathers nothing over the batch axis, and one that couples
rows keeps being computed on global values. Each body runs on 2 gloo
ranks; the parent compares with the op on plain tensors in one process.
"""

import numpy as np
import torch

from tests import parity_models as pm
from tests.harness import run_on_ranks


def _pool_input():
    return (
        torch.arange(4 * 3 * 6 * 6, dtype=torch.float32)
        .reshape(4, 3, 6, 6)
        .cos()
    )


def _pool_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch.distributed.dtensor_gaps import fallback
    from keras.src.backend.torch.distributed.dtensor_gaps import refused_on_rows

    mesh = init_device_mesh("cpu", (2,))
    fallback.reset_fallback_counts()
    refused_on_rows.forget()
    steps = []
    for scale in (1.0, 2.0, 3.0):
        x = distribute_tensor(_pool_input() * scale, mesh, [Shard(0)])
        x.requires_grad_()
        with fallback.dtensor_fallback():
            y = torch.nn.functional.avg_pool2d(x, 2)
            (y * y).sum().backward()
        counts = fallback.fallback_counts()
        entry = counts["aten.avg_pool2d_backward.default"]
        steps.append(
            {
                "grad": x.grad.full_tensor().numpy(),
                "placements": [str(p) for p in x.grad.placements],
                "count": (entry.calls, entry.gathered_bytes, entry.reason),
            }
        )
    return steps


def test_a_per_sample_refused_op_gathers_nothing_after_its_check():
    from keras.src.backend.torch.distributed.dtensor_gaps import refused_on_rows

    per_rank = run_on_ranks(_pool_body, world_size=2)
    gathered_at_check = None
    for steps in per_rank:
        for step, (scale, result) in enumerate(zip((1.0, 2.0, 3.0), steps)):
            x = (_pool_input() * scale).requires_grad_()
            y = torch.nn.functional.avg_pool2d(x, 2)
            (y * y).sum().backward()
            np.testing.assert_allclose(
                result["grad"], x.grad.numpy(), rtol=1e-6
            )
            assert result["placements"] == ["S(0)"]
            calls, gathered, reason = result["count"]
            assert calls == step + 1, result["count"]
            if step == 0:
                # The first meeting: on global values, half of the input
                # and of the output gradient from the other rank.
                gathered_at_check = gathered
                assert gathered == (x.numel() + y.numel()) // 2 * 4
                assert reason != refused_on_rows.ON_ROWS
            else:
                # Then on the local rows: nothing more gathered.
                assert gathered == gathered_at_check, result["count"]


class _RunningSum:
    """A stand-in for an op that couples rows: a cumulative sum over them."""

    def __call__(self, x):
        return torch.cumsum(x, 0)

    def __str__(self):
        return "running_sum"


class _Doubled:
    """A stand-in for a per-sample op."""

    def __call__(self, x):
        return x * 2.0

    def __str__(self):
        return "doubled"


def _signature_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch.distributed.dtensor_gaps import global_values
    from keras.src.backend.torch.distributed.dtensor_gaps import refused_on_rows

    mesh = init_device_mesh("cpu", (2,))
    global_values.reset_fallback_counts()
    refused_on_rows.forget()
    out = {}
    for op in (_RunningSum(), _Doubled()):
        values = []
        for step in range(3):
            x = torch.arange(12, dtype=torch.float32).reshape(6, 2) + step
            xd = distribute_tensor(x, mesh, [Shard(0)])
            result = refused_on_rows.on_local_rows(op, (xd,), {}, None)
            if result is None:
                # As the fallback does then.
                result = global_values.on_global_values(
                    op, (xd,), {}, None, str(op)
                )
            values.append(result.full_tensor().numpy())
        entry = global_values.fallback_counts()[str(op)]
        out[str(op)] = (values, entry.calls, entry.gathered_bytes)
    return out


def test_the_check_keeps_rows_that_couple_on_global_values():
    per_rank = run_on_ranks(_signature_body, world_size=2)
    for out in per_rank:
        for op in (_RunningSum(), _Doubled()):
            values, calls, gathered = out[str(op)]
            for step, value in enumerate(values):
                x = torch.arange(12, dtype=torch.float32).reshape(6, 2) + step
                np.testing.assert_allclose(value, op(x).numpy())
            # Counted once per call on global values, and per call on the
            # rows after the first: the running sum gathers the other
            # rank's 3 rows (24 bytes) in each of its 3 calls, the doubling
            # only in its first.
            assert calls == 3, (str(op), calls)
            if isinstance(op, _RunningSum):
                assert gathered == 3 * 24, gathered
            else:
                assert gathered == 24, gathered


class _RefusedOnOneRank:
    """A per-sample op of two results whose kernel refuses rank 1's rows
    (3 of the 6) alone."""

    def __call__(self, x):
        import torch.distributed as dist

        if x.shape[0] == 3 and dist.get_rank() == 1:
            raise RuntimeError("this kernel refuses 3 rows")
        return x * 2.0, x + 1.0

    def __str__(self):
        return "refused_on_one_rank"


def _one_rank_refuses_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch.distributed.dtensor_gaps import global_values
    from keras.src.backend.torch.distributed.dtensor_gaps import refused_on_rows

    # Rows over the first mesh dimension, features over the second: the
    # check gathers each result's features, a collective of the second.
    mesh = init_device_mesh("cpu", (2, 2))
    global_values.reset_fallback_counts()
    refused_on_rows.forget()
    op, values, on_rows = _RefusedOnOneRank(), [], []
    for step in range(3):
        x = torch.arange(24, dtype=torch.float32).reshape(6, 4) + step
        xd = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
        result = refused_on_rows.on_local_rows(op, (xd,), {}, None)
        on_rows.append(result is not None)
        if result is None:
            result = global_values.on_global_values(
                op, (xd,), {}, None, str(op)
            )
        values.append([r.full_tensor().numpy() for r in result])
    return values, on_rows, global_values.fallback_counts()[str(op)].calls


def test_a_kernel_refusing_one_process_rows_keeps_all_on_global_values():
    # Rank 1's call on its rows fails where the others' agree: every
    # process still makes the check's collectives, then all take the
    # global path.
    per_rank = run_on_ranks(_one_rank_refuses_body, world_size=4)
    for values, on_rows, calls in per_rank:
        for step, (doubled, shifted) in enumerate(values):
            x = torch.arange(24, dtype=torch.float32).reshape(6, 4) + step
            np.testing.assert_allclose(doubled, (x * 2.0).numpy())
            np.testing.assert_allclose(shifted, (x + 1.0).numpy())
        # The first meeting returns the global results; then none on rows.
        assert on_rows == [True, False, False], on_rows
        assert calls == 3, calls


def _uneven_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    from keras.src.backend.torch.distributed.dtensor_gaps import global_values
    from keras.src.backend.torch.distributed.dtensor_gaps import refused_on_rows

    mesh = init_device_mesh("cpu", (2,))
    global_values.reset_fallback_counts()
    refused_on_rows.forget()
    op, found = _Doubled(), []
    # Even rows (checked, then on the rows), uneven rows (checked anew),
    # and a single row (the second process has none: never on the rows).
    for rows in (6, 6, 5, 5, 1):
        x = torch.arange(2 * rows, dtype=torch.float32).reshape(rows, 2)
        xd = distribute_tensor(x, mesh, [Shard(0)])
        before = global_values.fallback_counts().get(str(op))
        result = refused_on_rows.on_local_rows(op, (xd,), {}, None)
        after = global_values.fallback_counts().get(str(op))
        checked = getattr(after, "gathered_bytes", 0) > getattr(
            before, "gathered_bytes", 0
        )
        value = None if result is None else result.full_tensor().numpy()
        found.append((value, checked))
    return found


def test_uneven_and_empty_row_parts_are_checked_apart():
    per_rank = run_on_ranks(_uneven_body, world_size=2)
    for found in per_rank:
        checks = [checked for _, checked in found]
        assert checks == [True, False, True, False, False], checks
        for rows, (value, _) in zip((6, 6, 5, 5), found):
            x = torch.arange(2 * rows, dtype=torch.float32).reshape(rows, 2)
            np.testing.assert_allclose(value, (x * 2.0).numpy())
        assert found[-1][0] is None


def _pooling_fit(rank=None, world_size=None):
    """A pooling model made to run through DTensor (a mean over the batch
    outside any layer): the backward op of its pooling, which DTensor
    refuses on a batch-split image, runs on each process' rows after its
    check."""
    import keras
    from keras import ops
    from keras.src.backend.torch.distributed.dtensor_gaps import global_values
    from keras.src.backend.torch.distributed.dtensor_gaps import refused_on_rows
    from tests import distributions

    distributions.use_setting("dp" if rank is not None else "single")
    global_values.reset_fallback_counts()
    refused_on_rows.forget()
    keras.utils.set_random_seed(pm.SEED)
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(3, 3, padding="same")(inputs)
    x = keras.layers.AveragePooling2D(2)(x)
    x = keras.layers.Flatten()(x)
    x = x - ops.mean(x, axis=0, keepdims=True)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    steps = []
    for start in range(0, 16, 4):
        before = global_values.fallback_counts()
        model.train_on_batch(x[start : start + 4], y[start : start + 4])
        after = global_values.fallback_counts()
        steps.append(
            {
                name: (
                    count.calls - getattr(before.get(name), "calls", 0),
                    count.gathered_bytes
                    - getattr(before.get(name), "gathered_bytes", 0),
                )
                for name, count in after.items()
            }
        )
    weights = [np.array(w) for w in model.get_weights()]
    return {"weights": weights, "steps": steps}


def test_a_model_through_dtensor_gathers_no_rows_for_refused_ops():
    per_rank = run_on_ranks(_pooling_fit, world_size=2)
    reference = pm.run_single(_pooling_fit)
    for rank, result in enumerate(per_rank):
        pm.assert_close(
            {"weights": result["weights"]},
            {"weights": reference["weights"]},
            f"rank {rank}",
        )
        # The first step checks the refused op on global values; the
        # others compute it on the rows, gathering nothing.
        first, *others = result["steps"]
        assert list(first) == ["aten.avg_pool2d_backward.default"], first
        assert first["aten.avg_pool2d_backward.default"] == (1, 864), first
        for step in others:
            assert step == {"aten.avg_pool2d_backward.default": (1, 0)}, step
