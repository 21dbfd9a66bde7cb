"""Peak host memory of building a sharded Keras model: the memory check.

Launch with torchrun on 2 (or more) ranks::

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_memory.py
    ./run_multi_gpu.sh benchmarks/bench_memory.py --layers 4 --dim 1024

Builds, under `ModelParallel` on a ``(1, N)`` ("batch", "model") mesh, a
stack of `--layers` Dense layers of `--dim` x `--dim` float32 kernels, each
kernel sharded ``(None, "model")`` (defaults: 16 x 4096 x 4096 = 64 MiB per
kernel, 1 GiB in all). Each rank measures its peak resident memory (RSS)
increase while the model is built and checks

    peak increase <= own shards + largest single variable + allowance

that is: a rank may hold its own shards, plus one full variable at a time
while it is being created and scattered, plus `--allowance-mib` for the
allocator and Python; never the whole model. The peak is the kernel's
high-water mark (VmHWM in /proc/self/status), reset to the current RSS right
before the build (writing 5 to /proc/self/clear_refs); where the reset is not
allowed, the increase is measured from the RSS before the build to the
high-water mark after it, which can only overstate it.

Rank 0 prints one line per rank; every rank exits 1 when any rank broke the
bound (0 otherwise). `--json PATH` writes the numbers.
"""

import argparse
import gc
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import keras  # noqa: E402

MIB = 1024 * 1024


def parse_args(argv=None):
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--layers",
        type=int,
        default=16,
        help="Dense layers (one sharded kernel each)",
    )
    p.add_argument(
        "--dim", type=int, default=4096, help="kernel size: dim x dim float32"
    )
    p.add_argument(
        "--allowance-mib",
        type=float,
        default=64.0,
        help="slack for the allocator and Python, MiB (a "
        "negative value tightens the bound below the shards: "
        "the smoke test uses it to see the check fail)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads per rank"
    )
    p.add_argument("--json", metavar="PATH", help="write the results here")
    return p.parse_args(argv)


def memory_kib():
    """Current and peak resident memory of this process (KiB)."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0])
    return values["VmRSS"], values["VmHWM"]


def reset_peak():
    """Resets the high-water mark to the current RSS; False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def model_parallel():
    """`ModelParallel` on a (1, N) mesh, kernels sharded on "model"."""
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(
        (1, len(devices)), ("batch", "model"), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def build_model(layers, dim):
    """A stack of Dense layers; their variables are created here."""
    return keras.Sequential(
        [keras.Input((dim,))]
        + [keras.layers.Dense(dim, name=f"dense_{i}") for i in range(layers)]
    )


def local_bytes(variable):
    """Bytes of this rank's shard of a variable."""
    value = variable.value
    if hasattr(value, "to_local"):
        value = value.to_local()
    return value.numel() * value.element_size()


def global_bytes(variable):
    """Bytes of the whole (global) variable."""
    dtype = torch.empty((), dtype=variable.value.dtype)
    return int(np.prod(variable.shape)) * dtype.element_size()


def measure(args):
    """Builds the model; returns this rank's numbers (bytes)."""
    # Warm-up: a tiny model of the same layer types, so that lazy imports
    # and one-off setup (meshes, process groups) are not counted.
    warm = build_model(2, 64)
    del warm
    gc.collect()
    dist.barrier()
    exact = reset_peak()
    rss_before, _ = memory_kib()
    model = build_model(args.layers, args.dim)
    dist.barrier()
    rss_after, peak = memory_kib()
    variables = model.weights
    own = sum(local_bytes(v) for v in variables)
    largest = max(global_bytes(v) for v in variables)
    allowance = int(args.allowance_mib * MIB)
    increase = (peak - rss_before) * 1024
    return {
        "rank": dist.get_rank(),
        "peak_increase": increase,
        "rss_increase": (rss_after - rss_before) * 1024,
        "own_shards": own,
        "largest_variable": largest,
        "allowance": allowance,
        "bound": own + largest + allowance,
        "global_total": sum(global_bytes(v) for v in variables),
        "peak_reset": exact,
        "ok": increase <= own + largest + allowance,
    }


def report(results, args):
    """The lines rank 0 prints."""
    first = results[0]
    lines = [
        f"Model: {args.layers} Dense kernels of {args.dim}x{args.dim} "
        f"float32, sharded (None, 'model') over {len(results)} ranks; "
        f"global total {first['global_total'] / MIB:.1f} MiB",
        "Peak RSS increase while building "
        + (
            "(VmHWM reset before the build)"
            if first["peak_reset"]
            else "(VmHWM could not be reset: from VmRSS before, overstated)"
        ),
        f"{'rank':>4}{'peak +MiB':>11}{'RSS +MiB':>10}{'own shards':>12}"
        f"{'largest var':>13}{'allowance':>11}{'bound':>9}  result",
    ]
    for r in results:
        lines.append(
            f"{r['rank']:>4}{r['peak_increase'] / MIB:>11.1f}"
            f"{r['rss_increase'] / MIB:>10.1f}{r['own_shards'] / MIB:>12.1f}"
            f"{r['largest_variable'] / MIB:>13.1f}"
            f"{r['allowance'] / MIB:>11.1f}{r['bound'] / MIB:>9.1f}  "
            + (
                "ok"
                if r["ok"]
                else "FAIL: above own shards + largest variable + allowance"
            )
        )
    for r in results:
        transient = r["peak_increase"] - r["own_shards"]
        lines.append(
            f"rank {r['rank']}: peak - own shards = {transient / MIB:.1f} MiB"
            f" = {transient / r['largest_variable']:.2f} x the largest "
            "variable (the bound allows 1 x + allowance)"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    keras.distribution.initialize()
    keras.distribution.set_distribution(model_parallel())
    mine = measure(args)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, mine)
    if dist.get_rank() == 0:
        sys.stdout.write(report(results, args) + "\n")
        sys.stdout.flush()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "ranks": results}, f, indent=1)
    dist.barrier()
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
