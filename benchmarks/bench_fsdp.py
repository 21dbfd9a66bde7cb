"""Weights sharded over the batch axis: memory and step time, side by side.

    python benchmarks/bench_fsdp.py                 # 2 and 4 processes
    python benchmarks/bench_fsdp.py --procs 4 --json out.json

For each process count, one `torchrun` per implementation trains the same
stack of bias-free Dense layers with Adam (mean squared error, one global
batch split over the processes):

- `keras_fsdp`: Keras `ModelParallel`, every kernel `("batch", None)` on an
  (N, 1) ("batch", "model") mesh: weights gathered one layer at a time and
  freed after use (`torch/distributed/fsdp/fsdp.py`);
- `keras_fsdp_ahead`: the same, each layer's weights gathered while the
  layer before computes (`KERAS_DISTRIBUTION_GATHER_AHEAD=1`; on CPUs the
  default is `0`, as `keras_fsdp` runs);
- `keras_fsdp_kept`: the same, each layer's gathered weights kept until its
  backward (`KERAS_DISTRIBUTION_RESHARD_AFTER_FORWARD=0`, FSDP2's
  `reshard_after_forward=False`);
- `keras_fsdp_dtensor`: the same layout with
  `KERAS_DISTRIBUTION_GATHER_WEIGHTS=off`: DTensor's own plan;
- `native_fsdp2`: torch's `fully_shard` on each `nn.Linear` and the stack;
- `keras_mp`: Keras `ModelParallel`, a Megatron layout on a (1, N) mesh
  (kernels alternately `(None, "model")` and `("model", None)`);
- `keras_dp`: Keras `DataParallel`.

Memory: each process' peak resident memory (VmHWM) during `--steps`
training steps, after one warm-up step, above its resident memory before
the model was built; the ideal is weights + gradients + 2 Adam slots
divided by N. The memory runs allocate every block of 64 KiB or more with
`mmap` (`--mmap-threshold`), so that freed memory leaves the resident set:
with glibc's default dynamic threshold, blocks of a few MiB freed and
allocated again (gathered weights, gradients) stay in its heap, and the
peak measures its fragmentation as much as what is live. Time: the
median step of `--time-steps` steps on a smaller stack (`--time-layers`
kernels alternating `--time-dim` x `4 * --time-dim` and back, the MLP
of issue #25) in separate runs of the same workers. The table gives each
implementation's peak over the ideal, over `native_fsdp2`'s, and its step
time over `keras_dp`'s.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# A keras-hub Llama with its own `get_layout_map` (kernels over both axes)
# on a (2, 2) mesh, weights gathered or left to DTensor: `--llama`.
LLAMA_IMPLS = ("hub_llama_2x2", "hub_llama_2x2_dtensor")
IMPLS = (
    "keras_fsdp",
    "keras_fsdp_ahead",
    "keras_fsdp_kept",
    "keras_fsdp_dtensor",
    "native_fsdp2",
    "keras_mp",
    "keras_dp",
)
MIB = 1024 * 1024


def parse_args(argv=None):
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--impls", nargs="*", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--time-layers", type=int, default=4)
    p.add_argument("--time-dim", type=int, default=512)
    p.add_argument("--time-steps", type=int, default=20)
    p.add_argument(
        "--llama",
        action="store_true",
        help="also a keras-hub Llama on a (2, 2) mesh (4 processes; needs "
        "keras-hub, the `test` extra)",
    )
    p.add_argument(
        "--phases",
        nargs="+",
        default=["memory", "time"],
        choices=["memory", "time"],
        help="without the time phase, step times are the memory runs'",
    )
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="MALLOC_MMAP_THRESHOLD_ of the memory runs (bytes; 0: glibc's "
        "default): freed tensors leave the resident memory, which then "
        "measures what is live rather than what glibc's heap retains",
    )
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument(
        "--worker", choices=IMPLS + LLAMA_IMPLS, help=argparse.SUPPRESS
    )
    p.add_argument(
        "--phase", choices=("memory", "time"), help=argparse.SUPPRESS
    )
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    results = []
    for procs in args.procs:
        for impl in args.impls:
            row = {"procs": procs, "impl": impl}
            for phase in args.phases:
                row.update(_launch(args, procs, impl, phase))
            row.setdefault("step_ms", row.get("memory_step_ms"))
            results.append(row)
            print(_row_text(row), flush=True)
    if args.llama:
        for impl in LLAMA_IMPLS:
            row = {"procs": 4, "impl": impl}
            row.update(_launch(args, 4, impl, "memory"))
            row["step_ms"] = row["memory_step_ms"]
            results.append(row)
            print(_row_text(row), flush=True)
    print()
    print("\n".join(report(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


def _launch(args, procs, impl, phase):
    """Runs one implementation's workers; returns rank 0's summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={procs}",
            os.path.abspath(__file__),
            f"--worker={impl}",
            f"--phase={phase}",
            f"--out={out}",
        ] + _shape_flags(args)
        env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
        if args.mmap_threshold and phase == "memory":
            # Not for the time phase: a system call per tensor is slow.
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        start = time.perf_counter()
        done = subprocess.run(
            command,
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{impl} on {procs} processes ({phase}) failed:\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
            )
        with open(out) as f:
            result = json.load(f)
        result[f"{phase}_wall_s"] = time.perf_counter() - start
        return result


def _shape_flags(args):
    return [
        f"--layers={args.layers}",
        f"--dim={args.dim}",
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--time-layers={args.time_layers}",
        f"--time-dim={args.time_dim}",
        f"--time-steps={args.time_steps}",
    ]


def _row_text(row):
    peak = ""
    if "peak_mib" in row:
        peak = (
            f"peak {row['peak_mib']:8.0f} MiB (ideal {row['ideal_mib']:.0f}), "
        )
    return (
        f"{row['procs']} procs {row['impl']:<20} {peak}"
        f"step {row['step_ms']:8.1f} ms, loss {row['loss']:.6f}"
    )


def _ratio(row, other, key):
    if other is None or key not in row:
        return "-"
    return f"{row[key] / other[key]:.2f}x"


def report(results):
    """The table: peak over ideal and over FSDP2, step over DataParallel."""
    lines = [
        "| procs | implementation | peak MiB (max over processes) | "
        "/ ideal | / native_fsdp2 | step ms (median) | / keras_dp |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_key = {(r["procs"], r["impl"]): r for r in results}
    for r in results:
        fsdp2 = by_key.get((r["procs"], "native_fsdp2"))
        dp = by_key.get((r["procs"], "keras_dp"))
        peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else "-"
        lines.append(
            f"| {r['procs']} | {r['impl']} | {peak} | "
            f"{_ratio(r, {'peak_mib': r.get('ideal_mib')}, 'peak_mib')} | "
            f"{_ratio(r, fsdp2, 'peak_mib')} | {r['step_ms']:.1f} | "
            f"{_ratio(r, dp, 'step_ms')} |"
        )
    return lines


def _worker(args):
    os.environ["KERAS_BACKEND"] = "torch"
    if args.worker.endswith("_dtensor"):
        os.environ["KERAS_DISTRIBUTION_GATHER_WEIGHTS"] = "off"
    if args.worker == "keras_fsdp_ahead":
        os.environ["KERAS_DISTRIBUTION_GATHER_AHEAD"] = "1"
    if args.worker == "keras_fsdp_kept":
        os.environ["KERAS_DISTRIBUTION_RESHARD_AFTER_FORWARD"] = "0"
    import torch
    import torch.distributed as dist

    import keras

    sys.path.insert(0, HERE)
    from bench_memory import memory_kib
    from bench_memory import reset_peak

    torch.set_num_threads(1)
    keras.distribution.initialize()
    procs, rank = dist.get_world_size(), dist.get_rank()
    if args.phase == "memory":
        dims = [args.dim] * (args.layers + 1)
        steps = args.steps
    else:
        wide = 4 * args.time_dim
        dims = [args.time_dim] + [
            wide if i % 2 == 0 else args.time_dim
            for i in range(args.time_layers)
        ]
        steps = args.time_steps
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, dims[0])).astype("float32")
    y = rng.standard_normal((args.batch, dims[-1])).astype("float32")
    before = memory_kib()[0] * 1024
    if args.worker == "native_fsdp2":
        step, parameters = _native_fsdp2(dims, x, y, procs, rank)
    elif args.worker in LLAMA_IMPLS:
        step, parameters = _hub_llama(args.batch)
    else:
        step, parameters = _keras(args.worker, dims, x, y, procs)
    step()  # warm-up: the optimizer's slots, lazy imports
    dist.barrier()
    reset_peak()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    peak = memory_kib()[1] * 1024
    mine = torch.tensor(
        [float(peak - before), float(np.median(times))], dtype=torch.float64
    )
    gathered = [torch.zeros_like(mine) for _ in range(procs)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        result = {"loss": float(loss)}
        if args.phase == "memory":
            result["peak_mib"] = max(float(g[0]) for g in gathered) / MIB
            result["peaks_mib"] = [float(g[0]) / MIB for g in gathered]
            result["ideal_mib"] = 4 * parameters * 4 / procs / MIB
            result["memory_step_ms"] = (
                float(np.median([float(g[1]) for g in gathered])) * 1e3
            )
        else:
            result["step_ms"] = (
                float(np.median([float(g[1]) for g in gathered])) * 1e3
            )
        with open(args.out, "w") as f:
            json.dump(result, f)
    # The process group is destroyed at exit, by `keras.distribution`.
    dist.barrier()
    return 0


def _keras(impl, dims, x, y, procs):
    """A Keras model under `impl`'s distribution and its train step."""
    import keras

    devices = keras.distribution.list_devices()
    if impl == "keras_dp":
        distribution = keras.distribution.DataParallel(devices=devices)
    elif impl == "keras_mp":
        mesh = keras.distribution.DeviceMesh(
            (1, procs), ("batch", "model"), devices
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[r".*dense_\d*[02468]/kernel"] = (None, "model")
        layout_map[r".*dense_\d*[13579]/kernel"] = ("model", None)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    else:
        mesh = keras.distribution.DeviceMesh(
            (procs, 1), ("batch", "model"), devices
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = ("batch", None)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((dims[0],))]
        + [
            keras.layers.Dense(d, use_bias=False, name=f"dense_{i}")
            for i, d in enumerate(dims[1:])
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)

    def step():
        return model.train_on_batch(x, y)

    return step, parameters


def _hub_llama(batch):
    """A keras-hub Llama under its own layout map on a (2, 2) mesh."""
    import keras_hub

    import keras

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    keras.utils.set_random_seed(0)
    vocabulary, sequence = 8192, 64
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=vocabulary,
        num_layers=4,
        num_query_heads=8,
        num_key_value_heads=8,
        hidden_dim=512,
        intermediate_dim=1408,
    )
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    lm.compile(optimizer=keras.optimizers.Adam(1e-3))
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocabulary, size=(batch, sequence + 1))
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((batch, sequence), bool),
    }
    y = tokens[:, 1:].astype("int32")
    parameters = sum(int(np.prod(v.shape)) for v in lm.trainable_variables)

    def step():
        # The loss, without the compiled metrics.
        return lm.train_on_batch(x, y)[0]

    return step, parameters


def _native_fsdp2(dims, x, y, procs, rank):
    """torch FSDP2 (`fully_shard` per layer) and its train step."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (procs,))
    net = torch.nn.Sequential(
        *[torch.nn.Linear(a, b, bias=False) for a, b in zip(dims, dims[1:])]
    )
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    rows = len(x) // procs
    local_x = torch.from_numpy(x[rank * rows : (rank + 1) * rows])
    local_y = torch.from_numpy(y[rank * rows : (rank + 1) * rows])
    parameters = sum(a * b for a, b in zip(dims, dims[1:]))

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(net(local_x), local_y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step, parameters


if __name__ == "__main__":
    sys.exit(main())
