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
import collections
import json
import os
import statistics
import sys
import time

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODELS = ("Gemma", "Llama", "Qwen", "QwenMoe", "Qwen3Moe")
# `--config wide`: the catalogue's tiny models with feed-forward layers
# wider than the model (as in every preset): in the tiny ones, Gemma's
# gated halves and QwenMoe's shared expert are as wide as the model, and
# widths alone cannot tell which kernel reads the other's output.
WIDE = {"intermediate_dim": 64, "shared_expert_intermediate_dim": 32}
# `--config wide_heads`: wide, with 4 query and 2 key/value heads, so that
# a model axis of 4 divides the query heads (as it does every preset's).
WIDE_HEADS = dict(WIDE, num_query_heads=4, num_key_value_heads=2)
# `--config preset_shaped`: wide_heads with a 1024-token vocabulary, so
# that the embedding is as large a part of the model as in a preset and
# the key/value heads as small a part: `AutoModelParallel` then replicates
# key/value heads that the model axis does not divide (Megatron-LM's), as
# for a preset, where in the tiny models they exceed its memory budget
# (`auto_plan.REPLICATION_BUDGET`).
PRESET_SHAPED = dict(WIDE_HEADS, vocabulary_size=1024)
CONFIGS = {
    "wide": WIDE,
    "wide_heads": WIDE_HEADS,
    "preset_shaped": PRESET_SHAPED,
}
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


# Namespaces of collectives: c10d's own (the project's gradient buckets)
# and the functional ones DTensor issues.
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


class CountCollectives(TorchDispatchMode):
    """Counts collectives by op, as `CommDebugMode` does, without its module
    tracker (whose hooks fail on keras-hub's nested layers)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A mode runs before a tensor subclass: giving a `DTensor` op back
        # lets DTensor run it first, so that the collectives it issues
        # inside the op (redistributing an operand) come here too, as in
        # `CommDebugMode`.
        if any(t is DTensor for t in types):
            return NotImplemented
        name = func._opname
        # c10d's flat-buffer collectives are `_allgather_base_` and
        # `_reduce_scatter_base_` (`fsdp_gather`'s); the functional ones'
        # waits and autograd wrappers are none.
        if func.namespace in COLLECTIVE_NAMESPACES and not (
            "wait" in name or "wrap" in name
        ):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def count_collectives(step):
    """`{collective: count}` of one call of `step`."""
    with CountCollectives() as mode:
        step()
    return dict(mode.counts)


def build(name, config):
    """The catalogue's tiny causal LM `name`, changed as `CONFIGS[config]`
    says unless `config="tiny"`."""
    from tests import hub_catalogue as hc

    if config == "tiny":
        return hc.build_causal_lm(name)
    saved = hc.CONFIGS[name]
    hc.CONFIGS[name] = dict(
        saved, **{k: v for k, v in CONFIGS[config].items() if k in saved}
    )
    try:
        return hc.build_causal_lm(name)
    finally:
        hc.CONFIGS[name] = saved


def measure(name, plan, mesh, steps, config):
    """One model under one plan: bytes, collectives, step time."""
    import keras
    from tests import hub_catalogue as hc

    keras.distribution.set_distribution(None)
    use_plan(name, plan, mesh)
    lm = build(name, config)
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
    parser.add_argument(
        "--config", choices=("tiny",) + tuple(CONFIGS), default="wide"
    )
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
            result = measure(name, plan, mesh, args.steps, args.config)
            result["mesh"] = list(shape)
            result["config"] = args.config
            if torch.distributed.get_rank() == 0:
                print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
