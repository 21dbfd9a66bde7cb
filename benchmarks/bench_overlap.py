"""Keras `DataParallel`: overlapped buckets and local rows, each on/off.

Launch with torchrun, like `bench_step.py`::

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_overlap.py

For each model (the MLP and transformer blocks of `bench_step.py`, same
shapes and flags), it prints:

* a `torch.profiler` summary of one Keras `DataParallel` train step with
  its bucket sizes (in reverse variable order, 25 MiB each; on a GPU the
  first 1 MiB, as DDP's): when the backward pass ran and when each
  all-reduce started and ended, relative to the step's start; an
  all-reduce that starts before the backward pass ends overlaps it;
* step times, interleaved as in `bench_step.py`: `keras_dp` (as shipped:
  buckets launched during the backward pass, per-sample models on local
  rows), `keras_dp_one_bucket` (every gradient in one bucket, reduced
  after the backward pass: no overlap), `keras_dp_dtensor` (the model
  called on DTensors: no local rows), `native_ddp`, and the floor pair
  `keras_local_dp` / `native_local_dp` (see `bench_step.py`).
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
from bench_models import impl_shapes  # noqa: E402
from bench_models import make_data  # noqa: E402
from bench_models import reference_weights  # noqa: E402
from bench_runner import measure  # noqa: E402
from bench_runner import slowest_rank_times  # noqa: E402
from bench_runner import warm_up  # noqa: E402
from bench_step import parse_args  # noqa: E402
from keras_runners import keras_runner  # noqa: E402
from native_runners import native_runner  # noqa: E402

from keras.src.backend.torch.distributed.training import gradients  # noqa: E402
from keras.src.backend.torch.distributed.training import layer_call  # noqa: E402

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


def _on_dtensors(step):
    """`step` run with every model call on DTensors (no local rows)."""

    def run():
        techniques = layer_call.techniques
        call, techniques.rows_call = techniques.rows_call, lambda *args: None
        try:
            return step()
        finally:
            techniques.rows_call = call

    return run


def _variant(runner, impl, step):
    return dataclasses.replace(runner, impl=impl, step=step)


def build_runners(kind, args, device):
    """The runners of `kind`: the Keras variants, DDP and the floor."""
    ctx = sdpa_context(args, device)
    runners = []
    impls = ("keras_dp", "native_ddp", "keras_local_dp", "native_local_dp")
    for impl in impls:
        shapes = impl_shapes(impl, args.shapes, dist.get_world_size())
        ref = reference_weights(kind, shapes, args.seed)
        data = make_data(kind, shapes, args.seed, device)
        inputs = (kind, impl, shapes, ref, data, ctx, args)
        if impl.startswith("native"):
            runners.append(native_runner(*inputs, device))
            continue
        runners.append(keras_runner(*inputs))
        if impl == "keras_dp":
            one = keras_runner(*inputs)
            step = _with_buckets(one.step, ONE_BUCKET, ONE_BUCKET)
            runners.append(_variant(one, "keras_dp_one_bucket", step))
            dtensor = keras_runner(*inputs)
            step = _on_dtensors(dtensor.step)
            runners.append(_variant(dtensor, "keras_dp_dtensor", step))
    return runners


def profile_step(runner):
    """Backward span and all-reduce spans of one step, in ms from its start.

    Returns:
        `(backward, all_reduces)`: `(start, end)` of the backward pass (its
        first to last autograd node), and `(start, end)` of each
        all-reduce's call, in launch order (an asynchronous one returns
        once launched).
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
    for i, (start, _) in enumerate(reduces):
        # An asynchronous all-reduce's event ends when it is launched.
        where = "during" if start < backward[1] else "after"
        lines.append(
            f"  all-reduce {i + 1}: launched at {start:.1f} ms, {where} "
            "the backward pass"
        )
    return "\n".join(lines)


def format_times(runners):
    """Medians of each runner, and the ratios that isolate each change."""
    wall = {r.impl: statistics.median(r.times) for r in runners}
    cpu = {r.impl: statistics.median(r.cpu_times) for r in runners}
    lines = [
        f"  {r.impl:22s} median {wall[r.impl] * 1e3:8.2f} ms, cpu "
        f"{cpu[r.impl] * 1e3:8.2f} ms, first loss {r.first_loss:.5f}"
        for r in runners
    ]
    pairs = (
        ("keras_dp", "keras_dp_one_bucket", "overlap on / off"),
        ("keras_dp", "keras_dp_dtensor", "local rows on / off"),
        ("keras_dp", "native_ddp", "keras_dp / native_ddp"),
        ("keras_dp_dtensor", "native_ddp", "keras_dp_dtensor / native_ddp"),
        ("keras_local_dp", "native_local_dp", "floor"),
    )
    for a, b, what in pairs:
        lines.append(
            f"  {what:32s} {wall[a] / wall[b]:.3f}x "
            f"(cpu {cpu[a] / cpu[b]:.3f}x)"
        )
    floor_wall = wall["keras_local_dp"] / wall["native_local_dp"]
    floor_cpu = cpu["keras_local_dp"] / cpu["native_local_dp"]
    lines.append(
        "  keras_dp over its floor         "
        f"{wall['keras_dp'] / wall['native_ddp'] / floor_wall:.3f}x (cpu "
        f"{cpu['keras_dp'] / cpu['native_ddp'] / floor_cpu:.3f}x)"
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
            print(format_times(runners))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
