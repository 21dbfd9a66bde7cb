"""The implementations' names, the `Runner` each one is wrapped in, and how
runners are warmed up and timed.

`keras_runners` and `native_runners` build the runners; the functions here
drive them all alike.
"""

import dataclasses
import time
import warnings

import torch.distributed as dist
from bench_env import synchronize

MODELS = ("mlp", "transformer")
EAGER_IMPLS = ("keras_mp", "native_tp", "keras_dp", "native_ddp")
LOCAL_IMPLS = (
    "keras_local_tp",
    "native_local_tp",
    "keras_local_dp",
    "native_local_dp",
)
# Pristine Keras in a worker process, on the work of `keras_local_*`.
UPSTREAM_IMPLS = ("upstream_local_dp", "upstream_local_tp")
COMPILED_IMPLS = (
    "keras_mp_jit",
    "native_tp_compile",
    "keras_dp_jit",
    "native_ddp_compile",
)
# (Keras implementation, the one it is compared with).
PAIRS = (
    ("keras_mp", "native_tp"),
    ("keras_dp", "native_ddp"),
    ("keras_local_tp", "native_local_tp"),
    ("keras_local_dp", "native_local_dp"),
    ("keras_mp_jit", "native_tp_compile"),
    ("keras_dp_jit", "native_ddp_compile"),
    # This package against pristine Keras, no distribution on either side.
    ("keras_local_dp", "upstream_local_dp"),
    ("keras_local_tp", "upstream_local_tp"),
)
# Warning the Keras step wrapper gives when torch.compile fails.
EAGER_FALLBACK_TEXT = "Running the step eagerly instead"


@dataclasses.dataclass
class Runner:
    """One implementation of one model, ready to run training steps.

    Attributes:
        model: "mlp" or "transformer".
        impl: one of `EAGER_IMPLS` / `COMPILED_IMPLS`.
        step: runs one training step; returns the loss (tensor or None).
        activate: makes the runner's Keras distribution current.
        count: returns the collectives of one step (a dict), or None.
        state_bytes: returns this rank's bytes of parameters + optimizer
            state.
        ideal_collectives: the ideal number of collectives per step.
        ideal_bytes: the ideal per-rank bytes of parameters + optimizer
            state.
        loss_fn: turns a step's return value into the global loss (float).
        notes: remarks printed under the table.
        self_timed: `step` times itself and returns `(wall_s, cpu_s,
            loss)` (a runner in another process).
        close: releases what the runner holds (a worker process).
    """

    model: str
    impl: str
    step: object
    activate: object
    count: object
    state_bytes: object
    ideal_collectives: int
    ideal_bytes: int
    loss_fn: object
    notes: list = dataclasses.field(default_factory=list)
    self_timed: bool = False
    close: object = None
    times: list = dataclasses.field(default_factory=list)
    cpu_times: list = dataclasses.field(default_factory=list)
    first_loss: float = float("nan")
    collectives: dict = None
    bytes: int = 0

    @property
    def name(self):
        return f"{self.model}/{self.impl}"


def warm_up(runner, steps):
    """Untimed steps; records the first step's global loss and whether a
    compiled Keras step fell back to eager."""
    runner.activate()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.first_loss = runner.loss_fn(runner.step())
    for w in caught:
        message = " ".join(str(w.message).split())
        if EAGER_FALLBACK_TEXT in message:
            # The reason is in parentheses: "... model (Error: reason). ..."
            reason = message[message.find("(") + 1 : message.rfind(")")]
            runner.notes.append(
                "jit_compile fell back to eager: " + reason[:300]
            )
    for _ in range(steps - 1):
        runner.step()


def measure(runners, args, device):
    """Interleaved timing: `rounds` rounds of `steps` steps of each runner,
    in an order rotated every round."""
    for r in range(args.rounds):
        shift = r % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.activate()
            for _ in range(args.steps):
                dist.barrier()
                wall, cpu = _timed_step(runner, device)
                runner.times.append(wall)
                runner.cpu_times.append(cpu)


def _timed_step(runner, device):
    """Wall and CPU seconds of one step of `runner`."""
    if runner.self_timed:
        wall, cpu, _ = runner.step()
        return wall, cpu
    start = time.perf_counter()
    cpu_start = time.process_time()
    runner.step()
    synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu_start


def slowest_rank_times(runners):
    """Per step, the times of the slowest rank (collective over all ranks).

    Wall time, and CPU time of the process: the CPU time leaves out the
    time a rank was not scheduled or waited for the others, so it is less
    noisy on a busy machine (it does not see GPU work).
    """
    mine = [(r.times, r.cpu_times) for r in runners]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for i, runner in enumerate(runners):
        runner.times = [max(ts) for ts in zip(*(e[i][0] for e in everyone))]
        runner.cpu_times = [max(ts) for ts in zip(*(e[i][1] for e in everyone))]
