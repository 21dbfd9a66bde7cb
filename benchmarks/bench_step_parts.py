"""What a part of the data-parallel step costs where it runs: the step of one
`DataParallel` model with that part made free, in turns with the same step
unchanged and with Keras' own step on DDP, in the same processes.

    torchrun --nproc_per_node=2 benchmarks/bench_step_parts.py \\
        --model mlp_dropout --parts generator_check seed_key \\
        --rounds 30

A part is made free by swapping the library functions doing it for
stand-ins that skip its work (a check that always passes, a fixed key), so
the freed step's numbers may be wrong: this measures time, and is never a
mode. Timed in a profiler, a part costs several times less than inside the
step, where Python's caches are cold; ablated there, it costs what the step
would save without it.

Each round runs every side for `--block` timed steps (the first after a
switch untimed), the order rotated from round to round: the unchanged
`DataParallel` step, the same step again (`nothing` freed: the noise of
this measurement), the same model's step with each part freed in turn,
and `keras_step_ddp` of `weak_scaling_models` (Keras' own
`train_on_batch` on each process' rows, its model called through DDP). A
step's time is the slowest process'.
Prints, per freed part, the median step and what freeing it saved; and
whether the model still ran on its local rows (a freed part that made it
fall back to DTensor measured another path).
"""

import argparse
import contextlib
import statistics
import time

import weak_scaling_models

BLOCK = 10
_DIST = "keras.src.backend.torch.distributed."
# `{part: (what it is, [(module, attribute, stand-in factory)])}`.
PARTS = {
    "nothing": ("no part: the same step again, this measurement's noise", []),
    "generator_check": (
        "the global generators' check around each call on local rows",
        [
            (_DIST + "core.generator_states", "take", "_fixed_states"),
            (_DIST + "core.generator_states", "advanced", "_never"),
        ],
    ),
    "python_state": (
        "Python's generator state, read in that check",
        [(_DIST + "core.generator_states", "random", "_fixed_python")],
    ),
    "unseeded_key": (
        "a call's key from process 0's torch generator, for dropouts keyed "
        "by it (drawn, broadcast, counted)",
        [(_DIST + "core.random_draws", "start_key", "_fixed_key")],
    ),
    "seed_key": (
        "a draw's key from its seed generator (its state read and stepped)",
        [(_DIST + "core.random_draws", "seed_key", "_fixed_seed_key")],
    ),
    "position_mask": (
        "dropout's mask drawn by position (here a private generator's)",
        [
            (_DIST + "core.counter_draws", "keep_mask", "_private_mask"),
            (_DIST + "core.counter_draws", "keep_scale", "_private_scale"),
        ],
    ),
    "plain_rows_off": (
        "Keras' train step on plain rows turned off: the batch and outputs "
        "as DTensors again (what it saves is this, negated)",
        [(_DIST + "data_parallel.row_boundary", "plain_rows", "_declined")],
    ),
    "sdpa_switch": (
        "math SDPA for the step, the backends back for the local rows",
        [
            (_DIST + "training.layer_call", "_math_sdpa", "_no_context"),
            (_DIST + "training.layer_call", "_enabled_sdpa_backends", "_none"),
        ],
    ),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mlp", choices=weak_scaling_models.MODELS)
    p.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS)
    p.add_argument("--rows", type=int, default=32, help="rows per process")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--block", type=int, default=BLOCK, help="steps a turn")
    return p.parse_args()


def _stand_in(name, original):
    """The stand-in `name` for a library function `original`."""
    import random

    import torch

    if name == "_fixed_states":
        states = original()
        return lambda: states
    if name == "_never":
        return lambda *args, **kwargs: False
    if name == "_fixed_python":
        state = random.getstate()
        methods = {
            "getstate": staticmethod(lambda: state),
            "setstate": staticmethod(random.setstate),
        }
        return type("FixedPython", (), methods)
    if name == "_fixed_key":
        key = torch.tensor(0x5DEECE66D, dtype=torch.int64)
        return lambda: (key, None)
    if name == "_fixed_seed_key":
        return lambda seed: 0x5DEECE66D
    if name == "_private_mask":
        generator = torch.Generator().manual_seed(0)
        return lambda key, box, device, keep: (
            torch.rand(tuple(box[2]), generator=generator).to(device) < keep
        )
    if name == "_private_scale":
        generator = torch.Generator().manual_seed(0)
        return lambda key, box, device, keep, dtype: (
            (torch.rand(tuple(box[2]), generator=generator).to(device) < keep)
            .to(dtype)
            .mul_(1 / keep)
        )
    if name == "_no_context":
        return contextlib.nullcontext
    if name == "_none":
        return lambda: None
    if name == "_declined":
        return lambda *args: None
    raise ValueError(f"Unknown stand-in {name}.")


@contextlib.contextmanager
def freed(part):
    """The block runs with `part` (of `PARTS`, or `None`) made free."""
    import importlib

    swaps = []
    for module_name, attribute, stand_in in PARTS[part][1] if part else []:
        module = importlib.import_module(module_name)
        original = getattr(module, attribute)
        swaps.append((module, attribute, original))
        setattr(module, attribute, _stand_in(stand_in, original))
    try:
        yield
    finally:
        for module, attribute, original in reversed(swaps):
            setattr(module, attribute, original)


def _on_local_rows(model):
    """Whether `model`'s train steps still run on each process' rows."""
    from keras.src.backend.torch.distributed.training.step import model_step

    rows = model_step(model, "train").rows
    verdict = rows.verdicts.get(True)
    return bool(verdict and verdict.per_sample) and not (
        rows.runs_through_dtensor
    )


def main():
    import torch
    import torch.distributed as dist

    from keras import distribution as kd

    args = parse_args()
    torch.set_num_threads(1)
    kd.initialize()
    rank, size = dist.get_rank(), dist.get_world_size()
    model, step = weak_scaling_models.make_step(
        "keras_dp", args.model, args.rows, rank, size
    )
    distribution = kd.distribution()
    _, peer = weak_scaling_models.make_step(
        "keras_step_ddp", args.model, args.rows, rank, size
    )
    sides = [(None, distribution, step)]
    sides += [(part, distribution, step) for part in args.parts]
    sides.append(("peer", None, peer))
    times = {part: [] for part, _, _ in sides}
    for round_ in range(args.rounds):
        # Rotated: each side in each place of the round alike (a step after
        # another model's runs slower than one after the same model's).
        turn = round_ % len(sides)
        for part, side_distribution, side_step in sides[turn:] + sides[:turn]:
            kd.set_distribution(side_distribution)
            with freed(None if part == "peer" else part):
                side_step()
                for _ in range(args.block):
                    dist.barrier()
                    start = time.perf_counter()
                    side_step()
                    times[part].append(time.perf_counter() - start)
    medians = {}
    for part, values in times.items():
        per_step = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
        medians[part] = statistics.median(per_step.tolist()) * 1e3
    if rank == 0:
        _print(args, size, medians, _on_local_rows(model))


def _print(args, size, medians, local):
    base, peer = medians[None], medians["peer"]
    print(
        f"{args.model}, {size} process(es), {args.rows} rows each, "
        f"{args.rounds} rounds of {args.block} steps; medians:"
    )
    print(f"  Keras' step on DDP: {peer:.3f} ms")
    print(f"  DataParallel: {base:.3f} ms, {base / peer:.3f}x it")
    for part in args.parts:
        freed_ms = medians[part]
        print(
            f"  {part} freed: {freed_ms:.3f} ms, {freed_ms / peer:.3f}x; "
            f"saves {(base - freed_ms) * 1e3:.0f} us ({PARTS[part][0]})"
        )
    print(f"  still on the local rows after all: {local}")


if __name__ == "__main__":
    main()
