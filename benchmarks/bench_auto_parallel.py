"""`AutoModelParallel` against keras-hub's hand-written layout maps.

For each keras-hub backbone with a `get_layout_map` (Gemma, Llama, Qwen,
QwenMoe, Qwen3Moe), the tiny causal LM of `tests/hub_catalogue.py` trains
one step under the backbone's own map and under `AutoModelParallel` with no
map, on the same mesh. Per model and plan it reports the parameter bytes
this process stores (the largest over processes), the collectives of one
train step (`CommDebugMode`, by op) and the median step time. Launch::

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_auto_parallel.py
    torchrun --standalone --nproc_per_node=4 \\
        benchmarks/bench_auto_parallel.py --mesh 2,2

Rank 0 prints one `RESULT {...}` line per model and plan.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = ("Gemma", "Llama", "Qwen", "QwenMoe", "Qwen3Moe")
PLANS = ("own", "auto")


def use_plan(name, plan, mesh):
    """Sets the hand-written map of `name` (`"own"`) or `AutoModelParallel`."""
    from keras import distribution as kd
    from tests import hub_catalogue as hc

    if plan == "auto":
        kd.set_distribution(kd.AutoModelParallel(device_mesh=mesh))
        return
    layout_map = hc.backbone_class(name).get_layout_map(mesh)
    kd.set_distribution(
        kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )


def count_collectives(step):
    """`{collective: count}` of one call of `step`."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        step()
    return {
        str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()
    }


def measure(name, plan, mesh, steps):
    """One model under one plan: bytes, collectives, step time."""
    import keras
    from tests import hub_catalogue as hc

    keras.distribution.set_distribution(None)
    use_plan(name, plan, mesh)
    lm = hc.build_causal_lm(name)
    x, y, sample_weight = hc.make_data(name, num_samples=hc.BATCH)

    def step():
        lm.train_on_batch(x, y, sample_weight=sample_weight)

    step()  # the first step builds the optimizer and the step function
    collectives = count_collectives(step)
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    local, total = hc.parameter_bytes(lm)
    largest = torch.tensor([local, int(1000 * statistics.median(times))])
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    keras.distribution.set_distribution(None)
    return {
        "model": name,
        "plan": plan,
        "parameter_bytes": int(largest[0]),
        "model_bytes": total,
        "collectives": collectives,
        "collectives_total": sum(collectives.values()),
        "step_ms": int(largest[1]),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", default=None, help="e.g. 1,2 or 2,2")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import keras

    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    shape = (
        tuple(int(n) for n in args.mesh.split(","))
        if args.mesh
        else (1, len(devices))
    )
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
    for name in args.models.split(","):
        for plan in PLANS:
            result = measure(name, plan, mesh, args.steps)
            result["mesh"] = list(shape)
            if torch.distributed.get_rank() == 0:
                print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
