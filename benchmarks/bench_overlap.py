"""Keras `DataParallel`: gradient all-reduces overlapped with backward.

Launch with torchrun, like `bench_step.py`::

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_overlap.py

For each model (the MLP and transformer blocks of `bench_step.py`, same
shapes and flags), it prints:

* a `torch.profiler` summary of one Keras `DataParallel` train step with
  DDP's bucket sizes (first bucket 1 MiB, then 25 MiB, in reverse variable
  order): when the backward pass ran and when each all-reduce started and
  ended, relative to the step's start; an all-reduce that starts before
  the backward pass ends overlaps it;
* step times, interleaved as in `bench_step.py`: `keras_dp` (buckets
  launched during the backward pass), `keras_dp_one_bucket` (every
  gradient in one bucket, reduced after the backward pass: the behaviour
  before overlap) and `native_ddp`.
"""

import dataclasses
import os
import statistics

# Before anything imports keras: its backend is read at import.
os.environ.setdefault("KERAS_BACKEND", "torch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_env import machine_info  # noqa: E402
from bench_env import sdpa_context  # noqa: E402
from bench_env import setup  # noqa: E402
from bench_models import Shapes  # noqa: E402
from bench_models import make_data  # noqa: E402
from bench_models import reference_weights  # noqa: E402
from bench_runner import measure  # noqa: E402
from bench_runner import slowest_rank_times  # noqa: E402
from bench_runner import warm_up  # noqa: E402
from bench_step import parse_args  # noqa: E402
from keras_runners import keras_runner  # noqa: E402
from native_runners import native_runner  # noqa: E402

from keras.src.backend.torch.distributed import gradients  # noqa: E402

ONE_BUCKET = 1 << 40


def _with_buckets(step, first, rest):
    """`step` run with the given overlapped bucket sizes."""

    def run():
        saved = gradients.FIRST_BUCKET_BYTES, gradients.BUCKET_BYTES
        gradients.FIRST_BUCKET_BYTES, gradients.BUCKET_BYTES = first, rest
        try:
            return step()
        finally:
            gradients.FIRST_BUCKET_BYTES, gradients.BUCKET_BYTES = saved

    return run


def build_runners(kind, args, device):
    """`keras_dp`, `keras_dp_one_bucket` and `native_ddp` for `kind`."""
    ctx = sdpa_context(args, device)
    ref = reference_weights(kind, args.shapes, args.seed)
    data = make_data(kind, args.shapes, args.seed, device)
    overlapped = keras_runner(
        kind, "keras_dp", args.shapes, ref, data, ctx, args
    )
    one = keras_runner(kind, "keras_dp", args.shapes, ref, data, ctx, args)
    one = dataclasses.replace(
        one,
        impl="keras_dp_one_bucket",
        step=_with_buckets(one.step, ONE_BUCKET, ONE_BUCKET),
    )
    native = native_runner(
        kind, "native_ddp", args.shapes, ref, data, ctx, args, device
    )
    return [overlapped, one, native]


def profile_step(runner):
    """Backward span and all-reduce spans of one step, in ms from its start.

    Returns:
        `(backward, all_reduces)`: `(start, end)` of the backward pass (its
        first to last autograd node), and `(start, end)` of each
        all-reduce, in launch order.
    """
    runner.activate()
    dist.barrier()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        with torch.profiler.record_function("step"):
            runner.step()
    events = prof.events()
    step = next(e for e in events if e.name == "step")
    origin = step.time_range.start

    def span(e):
        return (
            (e.time_range.start - origin) / 1e3,
            (e.time_range.end - origin) / 1e3,
        )

    backward = [
        span(e)
        for e in events
        if e.name.startswith("autograd::engine::evaluate_function")
    ]
    reduces = sorted(
        span(e) for e in events if e.name.startswith("c10d::allreduce")
    )
    return (min(b[0] for b in backward), max(b[1] for b in backward)), reduces


def format_profile(kind, backward, reduces):
    lines = [
        f"{kind}: backward pass {backward[0]:.1f} -> {backward[1]:.1f} ms "
        "after the step started"
    ]
    for i, (start, end) in enumerate(reduces):
        where = "during" if start < backward[1] else "after"
        lines.append(
            f"  all-reduce {i + 1}: {start:.1f} -> {end:.1f} ms "
            f"(launched {where} the backward pass)"
        )
    return "\n".join(lines)


def main():
    args = parse_args()
    args.shapes = Shapes(
        args.batch, args.dim, args.hidden, args.seq_len, args.heads
    )
    device = setup(args)
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"Machine: {machine_info(args, device)}")
    for kind in args.models:
        runners = build_runners(kind, args, device)
        for runner in runners:
            warm_up(runner, args.warmup)
        backward, reduces = profile_step(runners[0])
        if rank0:
            print(format_profile(kind, backward, reduces))
        measure(runners, args, device)
        slowest_rank_times(runners)
        if rank0:
            base = statistics.median(runners[-1].times)
            for r in runners:
                median = statistics.median(r.times)
                cpu = statistics.median(r.cpu_times)
                print(
                    f"  {r.impl:22s} median {median * 1e3:8.2f} ms "
                    f"({median / base:.2f}x native_ddp), cpu "
                    f"{cpu * 1e3:8.2f} ms, first loss {r.first_loss:.5f}"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
