"""Bounded collectives, and clear errors when a process of the job fails.

Collectives are bounded by `start_timeout()` until the first step completes,
then by `step_timeout()`. A process whose own code raises writes why to the
job's store; one whose collective then fails raises `JobFailedError` naming
the step, the collective and the processes that failed or did not arrive.
"""

import contextlib
import datetime
import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

STEP_TIMEOUT_ENV = "KERAS_DISTRIBUTION_TIMEOUT"
START_TIMEOUT_ENV = "KERAS_DISTRIBUTION_START_TIMEOUT"
# Seconds: CPU steps are slower and CPU hosts more often shared.
DEFAULT_STEP_TIMEOUT = {"gloo": 300, "nccl": 120}
# The start waits longer: one process may load data or compile meanwhile.
START_TIMEOUT_FACTOR = 5
# A failed process' wait for the others' reports; the bound on store access.
REPORT_GRACE_SECONDS = 5.0
STORE_TIMEOUT_SECONDS = 5.0

_STORE_PREFIX = "keras_distribution_health"
_COLLECTIVE_FILES = ("distributed_c10d.py", "_functional_collectives.py")

_state = {
    "started": False,
    "steps": {},
    "running": None,
    "coordinator": None,
    "written": [],
}
# Not `runtime.log_debug`: the runtime imports this module.
_logger = logging.getLogger("keras.distribution")


class JobFailedError(RuntimeError):
    """A collective failed because another process failed, left or hung."""


def step_timeout():
    """Seconds a collective may wait once the first step has completed."""
    value = os.environ.get(STEP_TIMEOUT_ENV)
    if value is not None:
        return _positive_seconds(STEP_TIMEOUT_ENV, value)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return float(DEFAULT_STEP_TIMEOUT[backend])


def start_timeout():
    """Seconds a collective may wait before the first step has completed."""
    value = os.environ.get(START_TIMEOUT_ENV)
    if value is not None:
        return _positive_seconds(START_TIMEOUT_ENV, value)
    return START_TIMEOUT_FACTOR * step_timeout()


def current_timeout():
    """The bound of collectives issued now: start or step timeout."""
    return step_timeout() if _state["started"] else start_timeout()


def _positive_seconds(name, value):
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(
            f"{name} must be a positive number of seconds. Received: "
            f"{name}={value!r}"
        )
    return seconds


def bound_groups(groups):
    """Bounds every collective of process `groups` by `current_timeout()`."""
    timeout = datetime.timedelta(seconds=current_timeout())
    for group in groups:
        group.set_timeout(timeout)


def install(coordinator=None):
    """Reports this process' uncaught errors to the others; `coordinator`:
    the store's `"host:port"` (default: `MASTER_ADDR`, `MASTER_PORT`)."""
    _state["coordinator"] = coordinator
    previous = sys.excepthook
    if getattr(previous, "_keras_health", False):
        return

    def excepthook(error_type, error, error_traceback):
        report_failure(error)
        previous(error_type, error, error_traceback)

    excepthook._keras_health = True
    sys.excepthook = excepthook


@contextlib.contextmanager
def guarded_step(kind, all_groups):
    """Runs a `kind` step, a failed collective raising `JobFailedError`; after
    the first completed step, bounds `all_groups()` by `step_timeout()`."""
    steps = _state["steps"]
    steps[kind] = step = steps.get(kind, 0) + 1
    if "store" not in _state:
        # Once: a job without a reachable store still runs, unreported.
        _state["store"] = connect_store()
    if _state["written"]:
        # A caught earlier failure's stale report must not blame a later one.
        _clear_own_reports()
    _state["running"] = kind
    try:
        yield
    except JobFailedError:
        raise
    except Exception as error:
        if not is_transport_error(error):
            report_failure(error)
            raise
        raise _job_error(error, f"{kind} step {step}") from None
    finally:
        _state["running"] = None
    if not _state["started"]:
        _state["started"] = True
        bound_groups(all_groups())
        _logger.debug("collectives bounded by %s s", step_timeout())


def running_step():
    """The kind of step (`"train"`, ...) this process runs now, or `None`."""
    return _state["running"]


def step_counts():
    """Steps started per kind, e.g. `{"train": 12, "test": 3}`."""
    return dict(_state["steps"])


def report_failure(error):
    """Writes this process' `error` to the job's store, for the others; not
    one caused by another process, so that the first failure is named."""
    if isinstance(error, JobFailedError) or _world_size() == 1:
        return
    line = traceback.format_exception_only(type(error), error)[-1].strip()
    _store_set(f"failed/{dist.get_rank()}", line[:500])


def _world_size():
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def is_transport_error(error):
    """Whether `error` is a failed collective or store connection."""
    if isinstance(error, (dist.DistError, dist.DistBackendError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "gloo" in text or "Timed out" in text or "Connection" in text
    )


def _job_error(error, where):
    """The `JobFailedError` for a collective that failed during `where`."""
    rank, size = dist.get_rank(), dist.get_world_size()
    _store_set(f"waiting/{rank}", where)
    failed, silent = _peer_reports(rank, size, wait=False)
    if not failed and silent:
        # A launcher may end this process during the wait below (torchrun's
        # agent, once another node failed): its log names the suspects now.
        plural = "es" if len(silent) > 1 else ""
        print(
            f"keras.distribution: a collective failed during {where} on "
            f"process {rank}; no report yet from process{plural} "
            f"{', '.join(map(str, silent))} of {size}, which may have failed "
            f"or left (waiting up to {REPORT_GRACE_SECONDS:g} s).",
            file=sys.stderr,
            flush=True,
        )
        failed, silent = _peer_reports(rank, size)
    collective = _collective_in(error.__traceback__)
    detail = " ".join(str(error).split())[:300]
    if failed:
        process, reason = failed[0]
        message = (
            f"Process {process} of {size} failed or left during {where}, so "
            f"this process (process {rank}) stops too. Its error: {reason}. "
            f"Read the log of process {process} for its traceback."
        )
    elif "Timed out" in detail:
        message = (
            f"{where.capitalize()} timed out: {collective} waited more than "
            f"{current_timeout():g} s for the other processes "
            f"({_timeout_setting()}). {_describe_silent(silent, size)} "
            f"If it can legitimately take longer, raise that bound."
        )
    else:
        message = (
            f"{_describe_silent(silent, size, left=True)} This process "
            f"(process {rank}) stops during {where}: {collective} failed."
        )
    return JobFailedError(f"{message} (Transport error: {detail})")


def peer_failures():
    """`[(rank, what)]` of the other processes that reported an error or a
    failed collective, without waiting."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    if "store" not in _state:
        _state["store"] = connect_store()
    found = []
    for other in range(dist.get_world_size()):
        if other == dist.get_rank():
            continue
        reason = _store_get(f"failed/{other}")
        waiting = _store_get(f"waiting/{other}")
        if reason is None and waiting is not None:
            reason = f"a collective failed there during {waiting}"
        if reason is not None:
            found.append((other, reason))
    return found


def _peer_reports(rank, size, wait=True):
    """`([(rank, error)], [silent rank])`, after a short wait if `wait`."""
    deadline = time.monotonic() + min(REPORT_GRACE_SECONDS, step_timeout())
    others = [r for r in range(size) if r != rank]
    while True:
        failed, silent = [], []
        for other in others:
            reason = _store_get(f"failed/{other}")
            if reason is not None:
                failed.append((other, reason))
            elif _store_get(f"waiting/{other}") is None:
                silent.append(other)
        if not wait or failed or not silent or time.monotonic() > deadline:
            return failed, silent
        time.sleep(0.2)


def _describe_silent(silent, size, left=False):
    if not silent:
        return "Every other process also waits in a collective."
    names = ", ".join(str(r) for r in silent)
    plural = "es" if len(silent) > 1 else ""
    what = "failed or left" if left else "did not arrive"
    return (
        f"Process{plural} {names} of {size} {what} (no answer within "
        f"{REPORT_GRACE_SECONDS:g} s: stopped, stuck or gone); read "
        f"{'their' if plural else 'its'} log."
    )


def _timeout_setting():
    if _state["started"]:
        return STEP_TIMEOUT_ENV
    return f"{START_TIMEOUT_ENV}: the first step has not completed yet"


def _collective_in(error_traceback):
    """Names the collective in a traceback, and the Keras code that ran it."""
    frames = traceback.extract_tb(error_traceback)
    collective, caller = None, None
    for frame in frames:
        filename = frame.filename.replace(os.sep, "/")
        if filename.endswith(_COLLECTIVE_FILES) and collective is None:
            collective = frame.name
        elif "/keras/src/" in filename and collective is None:
            caller = f"{filename.split('/keras/src/')[-1]}:{frame.lineno}"
    if collective is None:
        return "a collective"
    if collective.startswith("wait"):
        # DTensor's collectives run asynchronously; a use waits for them.
        where = f" (waited for at keras/src/{caller})" if caller else ""
        return f"an asynchronous DTensor collective{where}"
    where = f" (called from keras/src/{caller})" if caller else ""
    return f"the collective `{collective}`{where}"


def _job_store():
    """A client of the job's rendezvous store, or `None` without one."""
    host = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    coordinator = _state["coordinator"]
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
    if not host or not port or _world_size() == 1:
        return None
    store = dist.TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=datetime.timedelta(seconds=STORE_TIMEOUT_SECONDS),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"{_STORE_PREFIX}/{attempt}", store)


def connect_store(required=False):
    """A new client of the job's store, or `None` (one process, no store, or
    unreachable unless `required`: then it raises, as a process without it
    would skip an agreement the others wait for in it)."""
    try:
        return _job_store()
    except Exception as error:  # Reports are best effort; steps go on.
        if required:
            raise RuntimeError(
                f"This process cannot reach the job's store ({error}), where "
                "the processes agree on their collective calls. Check that "
                "every process reaches MASTER_ADDR:MASTER_PORT (or the "
                "coordinator given to `keras.distribution.initialize`)."
            ) from error
        _logger.debug("health: no store: %s", error)
        return None


def _store_set(key, value):
    if "store" not in _state:
        _state["store"] = connect_store()
    store = _state["store"]
    try:
        if store is not None:
            store.set(key, value)
            _state["written"].append(key)
    except Exception as error:  # The store's host may be the one gone.
        _logger.debug("health: cannot write %s: %s", key, error)


def _clear_own_reports():
    written, _state["written"] = _state["written"], []
    for key in written:
        try:
            _state["store"].delete_key(key)
        except Exception as error:  # The store's host may be the one gone.
            _logger.debug("health: cannot delete %s: %s", key, error)


def _store_get(key):
    store = _state.get("store")
    try:
        if store is None or not store.check([key]):
            return None
        return store.get(key).decode(errors="replace")
    except Exception as error:  # The store's host may be the one gone.
        _logger.debug("health: cannot read %s: %s", key, error)
        return None
