"""Collective timeouts (`start_timeout()`, then `step_timeout()`), errors
reported in the job's store, `JobFailedError`s naming who failed or hung."""

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
REPORT_GRACE_SECONDS = 5.0  # A failed process' report wait; store access bound.
_state = dict(started=False, steps={}, running=None, written=[])
# Not `runtime.log_debug`: the runtime imports this module.
_logger = logging.getLogger("keras.distribution")


class JobFailedError(RuntimeError):
    """A collective failed because another process failed, left or hung."""


def _seconds(name, default):
    """Environment variable `name` as positive seconds, else `default()`."""
    value = os.environ.get(name)
    if value is None:
        return default()
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


def step_timeout():
    """Seconds a collective may wait once the first step has completed (more
    on CPU: its steps are slower and its hosts more often shared)."""
    return _seconds(
        STEP_TIMEOUT_ENV, lambda: 120.0 if torch.cuda.is_available() else 300.0
    )


def start_timeout():
    """Seconds a collective may wait before the first step has completed:
    longer, as one process may load data or compile meanwhile."""
    return _seconds(START_TIMEOUT_ENV, lambda: 5 * step_timeout())


def current_timeout():
    """The bound of collectives issued now: start or step timeout."""
    return step_timeout() if _state["started"] else start_timeout()


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
    _state["steps"][kind] = step = _state["steps"].get(kind, 0) + 1
    _store()
    # A caught earlier failure's stale report must not blame a later one.
    written, _state["written"] = _state["written"], []
    for key in written:
        try:
            _state["store"].delete_key(key)
        except Exception as error:  # The store's host may be the one gone.
            _logger.debug("health: cannot delete %s: %s", key, error)
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


def step_counts_text():
    """`step_counts()` as store text, `"train=12,test=3"`."""
    return ",".join(f"{k}={n}" for k, n in _state["steps"].items())


def parse_step_counts(text):
    """The counts of `step_counts_text`'s `text`."""
    return {k: int(n) for k, n in (c.split("=") for c in text.split(",") if c)}


def report_failure(error):
    """Writes this process' `error` to the job's store, for the others; not
    one caused by another process, so that the first failure is named."""
    if isinstance(error, JobFailedError) or _world_size() == 1:
        return
    line = traceback.format_exception_only(type(error), error)[-1].strip()
    _store_report(f"failed/{dist.get_rank()}", line[:500])


def _world_size():
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def is_transport_error(error):
    """Whether `error` is a failed collective or store connection."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError)
        and any(s in str(error) for s in ("gloo", "Timed out", "Connection"))
    )


def name_processes(ranks):
    """`"process 1"` or `"processes 1, 2"`."""
    names = ", ".join(str(r) for r in ranks)
    return f"process {names}" if len(ranks) == 1 else f"processes {names}"


def _job_error(error, where):
    """The `JobFailedError` for a collective that failed during `where`."""
    rank, size = dist.get_rank(), dist.get_world_size()
    _store_report(f"waiting/{rank}", where)
    failed, silent = _peer_reports(wait=False)
    if not failed and silent:
        # A launcher may end this process during the wait below (torchrun's
        # agent, once another node failed): its log names the suspects now.
        print(
            f"keras.distribution: a collective failed during {where} on "
            f"process {rank}; no report yet from {name_processes(silent)} of "
            f"{size}, which may have failed or left (waiting up to "
            f"{REPORT_GRACE_SECONDS:g} s).",
            file=sys.stderr,
            flush=True,
        )
        failed, silent = _peer_reports()
    collective = _collective_in(error.__traceback__)
    detail = " ".join(str(error).split())[:300]
    silent_text = "Every other process also waits in a collective."
    if silent:
        silent_text = (
            f"{name_processes(silent).capitalize()} of {size} "
            f"{'did not arrive' if 'Timed out' in detail else 'failed or left'}"
            f" (no answer within {REPORT_GRACE_SECONDS:g} s: stopped, stuck "
            f"or gone); read {'their' if len(silent) > 1 else 'its'} log."
        )
    if failed:
        process, reason = failed[0]
        message = (
            f"Process {process} of {size} failed or left during {where}, so "
            f"this process (process {rank}) stops too. Its error: {reason}. "
            f"Read the log of process {process} for its traceback."
        )
    elif "Timed out" in detail:
        setting = STEP_TIMEOUT_ENV
        if not _state["started"]:
            setting = (
                f"{START_TIMEOUT_ENV}: the first step has not completed yet"
            )
        message = (
            f"{where.capitalize()} timed out: {collective} waited more than "
            f"{current_timeout():g} s for the other processes ({setting}). "
            f"{silent_text} If it can legitimately take longer, raise that "
            "bound."
        )
    else:
        message = (
            f"{silent_text} This process (process {rank}) stops during "
            f"{where}: {collective} failed."
        )
    return JobFailedError(f"{message} (Transport error: {detail})")


def peer_failures():
    """`[(rank, what)]` of others' failures reported in a step this process has
    not passed (an earlier step's report, until cleared, is of a caught one)."""
    if _world_size() == 1:
        return []
    return [
        (r, f"a collective failed there during {waiting}" if e is None else e)
        for r, (e, waiting) in _reports(current=True).items()
        if e is not None or waiting is not None
    ]


def _peer_reports(wait=True):
    """`([(rank, error)], [silent rank])`, after a short wait if `wait`."""
    deadline = time.monotonic() + min(REPORT_GRACE_SECONDS, step_timeout())
    while True:
        reports = _reports()
        failed = [(r, e) for r, (e, _) in reports.items() if e is not None]
        silent = [r for r, report in reports.items() if report == (None, None)]
        if not wait or failed or not silent or time.monotonic() > deadline:
            return failed, silent
        time.sleep(0.2)


def _reports(current=False):
    """`{rank: (error, step its collective failed in)}` of other processes;
    `None` if unreported or (if `current`) from before this process' step."""
    others = [r for r in range(dist.get_world_size()) if r != dist.get_rank()]
    return {
        r: (_report(f"failed/{r}", current), _report(f"waiting/{r}", current))
        for r in others
    }


def _store_report(key, text):
    """Writes `text` under `key` with this process' step counts."""
    try:
        if _store() is not None:
            _state["store"].set(key, f"{step_counts_text()}\t{text}")
            _state["written"].append(key)
    except Exception as error:  # The store's host may be the one gone.
        _logger.debug("health: cannot write %s: %s", key, error)


def _report(key, current=False):
    """The text of the report under `key`, or `None`; if `current`, `None`
    also for one written in a step before this process' current one."""
    value = _store_get(key)
    if value is None:
        return None
    steps, _, text = value.partition("\t")
    theirs, ours = parse_step_counts(steps), _state["steps"]
    behind = theirs != ours and all(
        n <= ours.get(k, 0) for k, n in theirs.items()
    )
    return None if current and behind else text


def _collective_in(error_traceback):
    """Names the collective in a traceback, and the Keras code that ran it."""
    collective, caller = None, None
    for frame in traceback.extract_tb(error_traceback):
        filename = frame.filename.replace(os.sep, "/")
        if filename.endswith(
            ("distributed_c10d.py", "_functional_collectives.py")
        ):
            collective = frame.name
            break
        if "/keras/src/" in filename:
            caller = f"{filename.split('/keras/src/')[-1]}:{frame.lineno}"
    if collective is None:
        return "a collective"
    if collective.startswith("wait"):  # Async DTensor collective: a use waits.
        what, how = "an asynchronous DTensor collective", "waited for at"
    else:
        what, how = f"the collective `{collective}`", "called from"
    return what + (f" ({how} keras/src/{caller})" if caller else "")


def _job_store():
    """A client of the job's rendezvous store, or `None` without one."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if _state.get("coordinator") is not None:
        host, _, port = _state["coordinator"].rpartition(":")
    if not host or not port or _world_size() == 1:
        return None
    timeout = datetime.timedelta(seconds=REPORT_GRACE_SECONDS)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"keras_distribution_health/{attempt}", store)


def connect_store(required=False):
    """A new client of the job's store, or `None` (one process, no store, or
    unreachable unless `required`: the others would wait for its agreements)."""
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


def _store():
    """This process' client of the job's store, connected on first use."""
    if "store" not in _state:
        _state["store"] = connect_store()
    return _state["store"]


def _store_get(key):
    try:
        if _store() is None or not _state["store"].check([key]):
            return None
        return _state["store"].get(key).decode(errors="replace")
    except Exception as error:  # The store's host may be the one gone.
        _logger.debug("health: cannot read %s: %s", key, error)
        return None
