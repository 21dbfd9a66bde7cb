"""Collective user calls (`get_weights`, `numpy()`, starting `fit`) announced
first in the job's store: made on some processes only, they raise, not hang."""

import atexit
import contextlib
import datetime
import inspect
import os
import threading
import time
import traceback

import torch
import torch.distributed as dist

from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.health import agreement
from keras.src.backend.torch.distributed.health import health

_WATCH_SECONDS = 0.05
_KEY = "call/{}"
_lock = threading.Lock()
# "tried": the process that tried to start (a forked one has another pid).
# "rank": this process', kept for announcing after the group is destroyed.
_state = dict.fromkeys(
    ("count", "depth", "store", "pid", "tried", "watcher", "rank")
)


class CallMismatchError(ValueError):
    """Processes made different collective calls under one number."""


def start():
    """Starts agreeing on calls in this process, once the job exists (also
    for a process group made without `keras.distribution.initialize`)."""
    if (
        _state["tried"] == os.getpid()
        or not dist.is_initialized()
        or dist.get_world_size() == 1
        or torch.utils.data.get_worker_info() is not None
    ):
        return
    store = health.connect_store(required=True)
    watcher_store = health.connect_store(required=True)
    _state["tried"] = os.getpid()
    if store is None or watcher_store is None:
        return
    stop_event = threading.Event()
    watcher = threading.Thread(
        target=_watch,
        args=(watcher_store, stop_event),
        name="keras-call-agreement",
        daemon=True,
    )
    _state.update(store=store, pid=os.getpid(), count=0, depth=0)
    _state["rank"] = dist.get_rank()
    _state.update(watcher=watcher, stop=stop_event)
    watcher.start()
    atexit.register(stop)  # Runs before the process group's teardown (LIFO).


def stop(reason="the end of its program"):
    """Tells the other processes that this one makes no more calls."""
    if _state["pid"] != os.getpid():
        return
    with _lock:
        _state["stop"].set()
        _state["count"] += 1
        _state["pid"] = None
        try:
            _append(_state["store"], _state["count"], reason)  # Wakes watcher.
        except dist.DistStoreError as error:
            # The store's host (a launcher, process 0) may be gone first.
            runtime.log_debug("call agreement: cannot announce: %s", error)
    _state["watcher"].join(timeout=1.0)


@contextlib.contextmanager
def collective_call(description):
    """Unless nested, in a step or tracing, waits for all processes to announce
    `description` (else `CallMismatchError`, on timeout `JobFailedError`)."""
    start()
    if not (
        _state["pid"] == os.getpid()
        and _state["depth"] == 0
        and health.running_step() is None
        and not torch.compiler.is_compiling()
        and threading.current_thread() is threading.main_thread()
    ):
        yield
        return
    _agree(description)
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1


def check_same_num_batches(num_batches, sizes=None):
    """Agrees on the start of `fit`/`evaluate`/`predict`; raises on every
    process if their `num_batches` (or `steps_per_epoch`, or `None`) differ.
    Returns whether every process gave the same `sizes` of its batches (a
    description; `None` if unknown)."""
    distribution = runtime.current_distribution()
    if distribution is None:
        return False
    with collective_call(_iterating_method()):
        texts = agreement.gather_if_different(f"{num_batches}\t{sizes}")
    counts = texts and [text.split("\t")[0] for text in texts]
    if counts and all(count == counts[0] for count in counts):
        counts = None
    unknown = num_batches is None and not distribution.auto_shard_dataset
    if counts is None and unknown and runtime.world_size() > 1:
        raise ValueError(
            "With `auto_shard_dataset=False` each process iterates over its "
            "own data, whose number of batches is unknown here (a generator, "
            "or a dataset of unknown cardinality): a process whose data ends "
            "first would pair its next steps with the others' steps. Pass the "
            "same `steps_per_epoch` (and `validation_steps`) on every process."
        )
    if counts is None:
        return texts is None and sizes is not None
    per_process = ", ".join(f"process {i}: {n}" for i, n in enumerate(counts))
    raise ValueError(
        "Every process must iterate over the same number of batches (every "
        f"step needs every process). Received: {per_process} batches "
        "('None' is unknown). Give every process as many batches (the same "
        "global data; with `auto_shard_dataset=False`, e.g. drop the "
        "remainder), or pass the same `steps_per_epoch` (and "
        "`validation_steps`) on every process."
    )


def _iterating_method():
    """Names the trainer method that starts iterating, for errors."""
    for frame, _ in traceback.walk_stack(inspect.currentframe()):
        name, filename = frame.f_code.co_name, frame.f_code.co_filename
        if name in ("fit", "evaluate", "predict") and "trainer" in filename:
            return f"the start of `{name}`"
    return "the start of iterating over a dataset"


def _agree(description):
    """Announces `description` and waits for every process' announcement."""
    store, rank, size = _state["store"], dist.get_rank(), dist.get_world_size()
    with _lock:
        _state["count"] += 1
        number = _state["count"]
        _append(store, number, description)
    deadline, pause = time.monotonic() + health.current_timeout(), 0.001
    while True:
        calls = {r: call for r, (_, call) in _entries(store, number).items()}
        others = sorted(r for r, call in calls.items() if call != description)
        if others:
            same = sorted(r for r in calls if r not in others)
            instead = "; ".join(f"process {r}: {calls[r]}" for r in others)
            raise CallMismatchError(
                f"{health.name_processes(same).capitalize()} made a "
                f"collective call that {health.name_processes(others)} did "
                f"not make in the same order: {description}. Instead, "
                f"{instead}. This process is process {rank}. Every process "
                "of the job must make this call, in the same order (e.g. "
                "`weights = model.get_weights()` on every process, then use "
                "`weights` on process 0 only). To look at this process' own "
                "part of a sharded variable without a collective, read "
                "`variable.value.to_local()` (a `DTensor` method)."
            )
        if len(calls) == size:
            break
        if time.monotonic() > deadline:
            missing = [r for r in range(size) if r not in calls]
            missing = health.name_processes(missing)
            raise health.JobFailedError(
                f"Process {rank} waited more than {health.current_timeout():g}"
                f" s for {missing} to make the same collective call: "
                f"{description}. "
                f"{health.name_processes(sorted(calls)).capitalize()} made "
                f"it; {missing} did not (other work or collectives, or "
                "stuck). Every process must make this call in the same "
                "order; if they legitimately take longer to reach it, raise "
                f"{health.STEP_TIMEOUT_ENV}."
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
    if rank == 0 and number > 2:
        # All announced `number`: nobody reads `number - 2` any more.
        store.delete_key(_KEY.format(number - 2))


def _append(store, number, description):
    # At exit the script may have destroyed its process group: no get_rank.
    line = f"{_state['rank']}\t{health.step_counts_text()}\t{description}"
    store.append(_KEY.format(number), line.replace("\n", " ") + "\n")


def _entries(store, number):
    """`{rank: (step counts, description)}` announced under `number`."""
    entries = {}
    for line in store.get(_KEY.format(number)).decode().splitlines():
        rank, counts, description = line.split("\t", 2)
        entries.setdefault(  # A process' first line per number stands.
            int(rank), (health.parse_step_counts(counts), description)
        )
    return entries


def _watch(store, stop_event):
    """The watcher thread: announces a step that rules out a pending call."""
    while True:
        with _lock:
            # Under the lock: `stop` sets the event and announces the next
            # number at once, so this wait either sees the event or wakes.
            if stop_event.is_set():
                return
            number = _state["count"] + 1
        try:
            store.wait([_KEY.format(number)], datetime.timedelta(days=1))
        except dist.DistStoreError:
            # The store's host has ended (the job is over), or a day passed.
            if stop_event.wait(_WATCH_SECONDS):
                return
            continue
        while not stop_event.is_set() and _state["count"] < number:
            with _lock:
                if _state["count"] < number:
                    _rule_out(store, number)
            if _state["count"] < number:
                stop_event.wait(_WATCH_SECONDS)


def _rule_out(store, number):
    """Announces this process' step under `number` if it rules the call out:
    the caller has not run it, so the two would wait for each other."""
    counts = health.step_counts()
    for theirs, _ in _entries(store, number).values():
        ahead = [k for k, n in counts.items() if n > theirs.get(k, 0)]
        if ahead:
            kind = ahead[0]
            what = "runs" if health.running_step() == kind else "ran"
            of = "(of `fit`, `evaluate`, `predict` or `*_on_batch`)"
            _append(store, number, f"{what} {kind} step {counts[kind]} {of}")
            _state["count"] = number
            return
