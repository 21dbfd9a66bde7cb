"""Multi-rank test harness: run test bodies on N real processes over gloo.

Every multi-rank test in this project runs its body in real worker
processes joined in a `torch.distributed` gloo process group, the way
`torchrun` would start them, but without paying a `torchrun` start-up per
assertion: one worker *pool* per world size is started lazily the first
time a test needs it and is reused by every later test of the pytest
session.

Writing a test
--------------
A test body is a plain **module-level function** (it is sent to the
workers by reference: module name + qualified name, so lambdas, nested
functions and functions defined in `__main__` are refused). It is called
on every rank as::

    body(rank, world_size, *args, **kwargs)

and its return value (anything picklable: numbers, numpy arrays, dicts,
...) is sent back. `run_on_ranks` returns the list of per-rank values,
ordered by rank::

    from tests.harness import run_on_ranks

    def _allreduce_body(rank, world_size, scale):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item() * scale

    def test_allreduce():
        assert run_on_ranks(
            _allreduce_body, world_size=2, kwargs={"scale": 10}
        ) == [10.0, 10.0]

Every argument after `fn` is a keyword. A call that may take longer than
`DEFAULT_TIMEOUT`, or that should give up sooner (a test expecting a
hang), says so with `timeout=` (see "Timeouts").

Exceptions *expected* by a test should be caught inside the body (and
e.g. their message returned): any exception escaping a body fails the
call and recycles the pool.

What the workers look like
--------------------------
Each worker is forked from a multiprocessing "forkserver" that has imported
torch and keras once (`tests/worker_preload.py`, with `KERAS_BACKEND=torch`
and one thread), so that starting a pool costs no imports; the worker then
gets the environment `torchrun` would give it:
`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
`MASTER_ADDR=127.0.0.1`, `MASTER_PORT`, plus `KERAS_BACKEND=torch`,
`OMP_NUM_THREADS=1` and `GLOO_SOCKET_IFNAME=lo`. It then runs
`torch.set_num_threads(1)`, joins the default gloo process group
(`torch.distributed.is_initialized()` is True for the body; code that
calls `init_process_group` again must check that first, as
`keras.distribution.initialize()` does) and imports keras once.

The rendezvous store is a `torch.distributed.TCPStore` owned by the
parent process and bound to port 0, so the port is picked by the kernel
at run time (never a fixed port, no bind-then-release race);
`MASTER_PORT` is that port.

Isolation
---------
* After a successful call every worker restores `os.environ` and the
  working directory, resets torch's default dtype / device / grad mode,
  and, when keras was imported, `keras.distribution.set_distribution(None)`,
  `keras.backend.clear_session()` and floatx / epsilon / image data format.
* After a failed call (an exception on any rank, a timeout, a dead
  worker) the process group may be broken, so the pool is killed; the
  next call starts a fresh one.

Failures
--------
A failed call raises `MultiRankError` (an `AssertionError`) whose message
has one section per rank: "ok", the rank's formatted traceback, its exit
code when it died, or -- for a rank that did not answer in time -- the
Python stacks of all its threads (dumped by `faulthandler` on SIGUSR1
just before the worker is killed), so a deadlock shows where each rank
is stuck. Anything the workers print is forwarded, prefixed with
`[rank N]`, to the caller's stdout after each call (pytest shows it as
captured output of the test).

Timeouts
--------
Every call is bounded, and its bound is stated in one place: its own
`timeout=` keyword (seconds), `DEFAULT_TIMEOUT` (180 s) when it has none.
Nothing else changes it (no module attribute, environment variable or
pytest marker), so the call site tells the whole story. Starting a pool
has its own limit (`MULTIRANK_STARTUP_TIMEOUT`, 180 s), not counted in
the call's; the forkserver's own imports (before the first pool) are
bounded only by pytest-timeout.

Integration tests that need a real `torchrun` use `run_torchrun`, bounded
the same way: its `timeout=` keyword (default 300 s).

The pools are not thread-safe: call `run_on_ranks` from one thread.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import datetime
import faulthandler
import gc
import importlib
import math
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Any
from typing import Callable
from typing import Sequence

# NOTE: this module must not import torch or keras at module level: the
# workers and the forkserver import it, and only `worker_preload` decides
# the environment torch and keras are imported with.

# Bound of a call that states none. Generous: the machine is small and
# shared (4 ranks may share 2 cores), and a loaded run must not flake.
DEFAULT_TIMEOUT = 180.0
STARTUP_TIMEOUT = float(os.environ.get("MULTIRANK_STARTUP_TIMEOUT", "180"))
# Collective timeout of the workers' process group. Longer than the short
# timeouts deadlock tests use, so the harness (which dumps stacks) fires
# first there; still bounded so a stuck worker cannot outlive its parent.
PROCESS_GROUP_TIMEOUT = 60.0

# The directory holding this module's top-level package: the repository root
# for `tests.harness`, and the same for the copy the export places in Keras'
# tree (`tools/export_plan.toml`), however deep.
_REPO_ROOT = os.path.abspath(__file__)
for _ in __name__.split("."):
    _REPO_ROOT = os.path.dirname(_REPO_ROOT)
_STACK_DUMP_SIGNAL = signal.SIGUSR1
# Once one rank failed, the others usually wait for it in a collective:
# give them this long to finish on their own before dumping their stacks.
_GRACE_AFTER_FAILURE = 3.0
_STACK_DUMP_WAIT = 2.0
_SHUTDOWN_JOIN_TIMEOUT = 10.0
_LOG_TAIL_LINES = 40


class MultiRankError(AssertionError):
    """A multi-rank call failed; the message has one section per rank.

    Attributes:
        outcomes: the `RankOutcome` of every rank, ordered by rank.
    """

    def __init__(self, message: str, outcomes: Sequence["RankOutcome"]):
        super().__init__(message)
        self.outcomes = list(outcomes)


@dataclasses.dataclass
class RankOutcome:
    """What one rank did during one call.

    Attributes:
        rank: the rank.
        status: "ok", "error" (the body raised), "died" (the worker
            process exited), "timeout" (no answer before the deadline) or
            "stopped" (no answer, stopped because another rank failed).
        value: the body's return value when status is "ok".
        detail: the traceback, exit code or stack dump, as text.
    """

    rank: int
    status: str
    value: Any = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def run_on_ranks(
    fn: Callable[..., Any],
    *,
    world_size: int = 2,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[Any]:
    """Runs `fn(rank, world_size, *args, **kwargs)` on every rank.

    Args:
        fn: a module-level function of an importable module.
        world_size: number of ranks (processes) to run it on.
        args: extra positional arguments, pickled to every rank.
        kwargs: extra keyword arguments, pickled to every rank.
        timeout: seconds to wait for all ranks (pool start-up excluded).

    Returns:
        The return values of `fn`, ordered by rank.

    Raises:
        MultiRankError: when any rank raised, died or timed out. The pool
            of that world size is then recycled.
        TypeError: when `fn` or the arguments cannot be sent to workers.
        ValueError: when `timeout` is not a positive, finite number of
            seconds.
    """
    payload = _make_payload(fn, args, kwargs or {})
    timeout = _check_timeout(timeout)
    pool = _get_pool(world_size)
    try:
        outcomes = pool.run(payload, timeout)
    except BaseException:  # E.g. KeyboardInterrupt: answers still pending.
        _discard_pool(world_size)
        raise
    if all(outcome.ok for outcome in outcomes):
        return [outcome.value for outcome in outcomes]
    # The process group may be broken (a rank may even sit in a
    # collective): never reuse this pool.
    _discard_pool(world_size)
    raise MultiRankError(
        _format_failure(fn, world_size, timeout, outcomes), outcomes
    )


def pool_pids(world_size: int) -> list[int]:
    """Returns the worker PIDs of the pool of `world_size`, starting it."""
    return _get_pool(world_size).pids


def shutdown_pools() -> None:
    """Stops every pool: process groups destroyed, workers joined."""
    for world_size in list(_POOLS):
        pool = _POOLS.pop(world_size)
        pool.close(graceful=True)


@dataclasses.dataclass
class TorchrunResult:
    """Output of `run_torchrun`."""

    returncode: int
    stdout: str
    stderr: str


def run_torchrun(
    script: str | os.PathLike,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
    torchrun_args: Sequence[str] = (),
) -> TorchrunResult:
    """Runs `script` under `torchrun --standalone` with `nproc` ranks.

    torchrun picks its rendezvous port itself (port 0). The run gets its
    own process session, and on timeout the whole process tree (agent
    and ranks, which torchrun puts in sessions of their own) is
    signalled: first SIGABRT, which makes every Python process print its
    stacks (`PYTHONFAULTHANDLER=1`, core dumps off), then SIGKILL.

    Args:
        script: path of the Python script to run.
        nproc: number of ranks (`--nproc-per-node`).
        args: command-line arguments for the script.
        timeout: seconds before the whole run is killed.
        env: extra environment variables (override the defaults).
        check: raise when the run exits non-zero.
        torchrun_args: more torchrun options, e.g. `["--max-restarts=1"]`.

    Returns:
        The exit code and the decoded stdout and stderr.

    Raises:
        AssertionError: on timeout, or on a non-zero exit when `check`;
            the message has the tail of stdout and stderr.
    """
    command = [
        # No core files when SIGABRT makes the ranks dump their stacks.
        "sh",
        "-c",
        'ulimit -c 0 && exec "$0" "$@"',
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *torchrun_args,
        os.fspath(script),
        *map(str, args),
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_torchrun_env(env),
        # Its own session: nothing we signal can hit pytest itself.
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        stdout, stderr = _kill_process_tree(proc)
        timed_out = True
    result = TorchrunResult(
        proc.returncode,
        stdout.decode(errors="replace"),
        stderr.decode(errors="replace"),
    )
    if timed_out:
        raise AssertionError(
            f"torchrun {script} timed out after {timeout:g} s "
            f"(stacks dumped on SIGABRT)\n{_output_tails(result)}"
        )
    if check and result.returncode != 0:
        raise AssertionError(
            f"torchrun {script} exited with {result.returncode}\n"
            f"{_output_tails(result)}"
        )
    return result


# --------------------------------------------------------------------------
# Parent side: the pools
# --------------------------------------------------------------------------

_POOLS: dict[int, "_WorkerPool"] = {}


def _get_pool(world_size: int) -> "_WorkerPool":
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(graceful=False)
        pool = _WorkerPool(world_size)
        _POOLS[world_size] = pool
    return pool


def _discard_pool(world_size: int) -> None:
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close(graceful=False)


atexit.register(shutdown_pools)


class _WorkerPool:
    """N worker processes in one gloo process group, plus their pipes.

    Messages in both directions are pickled tuples sent as bytes, so that
    the worker can report an argument it fails to unpickle, and the
    parent a result it fails to unpickle, as an ordinary error.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.started_in = 0.0
        self._procs: list[multiprocessing.Process] = []
        self._conns: list[Connection] = []
        self._log_offsets = [0] * world_size
        self._tmpdir = tempfile.mkdtemp(prefix=f"multirank-{world_size}-")
        self._store = None
        self._closed = False
        try:
            self._start()
        except BaseException:  # Leave no half-started pool behind.
            self.close(graceful=False)
            raise

    # -- start-up ----------------------------------------------------------

    def _start(self) -> None:
        start = time.monotonic()
        port = self._start_store()
        context = _worker_context()
        sys_path = _worker_sys_path()
        for rank in range(self.world_size):
            parent_conn, child_conn = context.Pipe(duplex=True)
            proc = context.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    port,
                    child_conn,
                    self._log_path(rank),
                    self._stack_path(rank),
                    sys_path,
                    os.getpid(),
                ),
                name=f"multirank-{self.world_size}-rank{rank}",
            )
            proc.start()
            # Only the child may hold its end: then a dead child shows up
            # as EOF on our end.
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self._wait_until_ready()
        self.started_in = time.monotonic() - start

    def _start_store(self) -> int:
        # The parent owns the rendezvous store and lets the kernel pick
        # its port: nothing can steal it between choosing and binding.
        from torch.distributed import TCPStore

        self._store = TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT),
            wait_for_workers=False,
        )
        return self._store.port

    def _wait_until_ready(self) -> None:
        outcomes = self._collect(STARTUP_TIMEOUT)
        if all(outcome.ok for outcome in outcomes):
            return
        raise MultiRankError(
            f"could not start a pool of {self.world_size} gloo workers "
            f"(limit {STARTUP_TIMEOUT:g} s)\n" + _format_outcomes(outcomes),
            outcomes,
        )

    # -- calls -------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def alive(self) -> bool:
        return not self._closed and all(p.is_alive() for p in self._procs)

    def run(self, payload: bytes, timeout: float) -> list[RankOutcome]:
        """Sends one call to every rank and collects the outcomes."""
        message = pickle.dumps(("run", payload))
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:
                pass  # The worker is gone; _collect reports its death.
        outcomes = self._collect(timeout)
        self._forward_output()
        return outcomes

    def _collect(self, timeout: float) -> list[RankOutcome]:
        """Waits for one answer per rank, or for its death, or a deadline.

        Once a rank failed, the others get only `_GRACE_AFTER_FAILURE`
        more seconds: they are most likely blocked in a collective with
        the failed rank. Ranks still silent at the end get their stacks
        dumped.
        """
        outcomes: list[RankOutcome | None] = [None] * self.world_size
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(outcome is None for outcome in outcomes):
            now = time.monotonic()
            limit = deadline
            if failed_at is not None:
                limit = min(deadline, failed_at + _GRACE_AFTER_FAILURE)
            if now >= limit:
                break
            pending = [r for r, o in enumerate(outcomes) if o is None]
            handles = [self._conns[r] for r in pending]
            handles += [self._procs[r].sentinel for r in pending]
            wait_any(handles, limit - now)
            for rank in pending:
                outcome = self._poll_rank(rank)
                if outcome is None:
                    continue
                outcomes[rank] = outcome
                if not outcome.ok and failed_at is None:
                    failed_at = time.monotonic()
        status = "stopped" if failed_at is not None else "timeout"
        silent = [r for r, o in enumerate(outcomes) if o is None]
        stacks = self._dump_stacks(silent)
        for rank in silent:
            outcomes[rank] = RankOutcome(rank, status, detail=stacks[rank])
        return outcomes  # type: ignore[return-value]

    def _poll_rank(self, rank: int) -> RankOutcome | None:
        """Returns the rank's answer or death, or None if it has neither."""
        conn = self._conns[rank]
        try:
            if conn.poll():
                return _decode_reply(rank, conn.recv_bytes())
        except (EOFError, OSError):
            pass  # It died while (or before) answering.
        else:
            if self._procs[rank].is_alive():
                return None
        return self._death_outcome(rank)

    def _death_outcome(self, rank: int) -> RankOutcome:
        proc = self._procs[rank]
        proc.join(timeout=5)
        code = proc.exitcode
        detail = f"worker process {proc.pid} exited with code {code}"
        if code is not None and code < 0:
            detail += f" (killed by {signal.Signals(-code).name})"
        fatal = _read_text(self._stack_path(rank))
        if fatal:  # faulthandler's dump on a fatal signal (segfault...).
            detail += "\n" + fatal
        log_tail = _tail(_read_text(self._log_path(rank)), _LOG_TAIL_LINES)
        if log_tail:
            detail += "\nlast output of the worker:\n" + log_tail
        return RankOutcome(rank, "died", detail=detail)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Makes each live rank in `ranks` print its stacks; returns them."""
        if not ranks:
            return {}
        dumped = {}
        for rank in ranks:
            # Drop what an earlier dump (e.g. a fatal error) left there.
            open(self._stack_path(rank), "w").close()
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, _STACK_DUMP_SIGNAL)
                dumped[rank] = True
        deadline = time.monotonic() + _STACK_DUMP_WAIT
        stacks = {rank: "" for rank in ranks}
        while time.monotonic() < deadline:
            for rank in dumped:
                stacks[rank] = _read_text(self._stack_path(rank))
            if all(stacks[rank] for rank in dumped):
                # faulthandler writes in one go, but other threads' frames
                # follow the current one: let it finish.
                time.sleep(0.2)
                break
            time.sleep(0.05)
        for rank in ranks:
            text = _read_text(self._stack_path(rank))
            if not self._procs[rank].is_alive():
                text = "(worker not alive)\n" + text
            elif not text:
                text = "(no stack dump: the worker did not answer SIGUSR1)"
            stacks[rank] = text
        return stacks

    # -- output and shutdown -----------------------------------------------

    def _forward_output(self) -> None:
        """Copies what workers printed since last time to our stdout."""
        for rank in range(self.world_size):
            try:
                with open(self._log_path(rank), "rb") as log:
                    log.seek(self._log_offsets[rank])
                    data = log.read()
            except OSError:
                continue
            self._log_offsets[rank] += len(data)
            for line in data.decode(errors="replace").splitlines():
                print(f"[rank {rank}] {line}")

    def close(self, graceful: bool) -> None:
        """Stops the workers; `graceful` lets them destroy their group."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            self._request_shutdown()
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=_SHUTDOWN_JOIN_TIMEOUT)
        for conn in self._conns:
            conn.close()
        self._forward_output()
        # Drop the store after the workers: clients of a vanished store
        # would log connection errors.
        self._store = None
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _request_shutdown(self) -> None:
        message = pickle.dumps(("shutdown",))
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:
                pass
        deadline = time.monotonic() + _SHUTDOWN_JOIN_TIMEOUT
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))

    def _log_path(self, rank: int) -> str:
        return os.path.join(self._tmpdir, f"rank{rank}.log")

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._tmpdir, f"rank{rank}.stacks")


# --------------------------------------------------------------------------
# Parent side: helpers
# --------------------------------------------------------------------------


def _make_payload(fn: Callable, args: Sequence, kwargs: dict) -> bytes:
    """Pickles a by-reference call of `fn`, refusing what workers can't load."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise TypeError(
            f"{fn!r} must be a module-level function (not a lambda, a "
            "nested function or a partial): workers import it by name"
        )
    if module == "__main__":
        raise TypeError(
            f"{qualname} is defined in __main__, which workers cannot "
            "import: move it to an importable module"
        )
    try:
        return pickle.dumps((module, qualname, tuple(args), dict(kwargs)))
    except Exception as error:
        raise TypeError(
            f"arguments of {qualname} are not picklable: {error}"
        ) from error


def _check_timeout(timeout: Any) -> float:
    # No unbounded call: a hang must end in a report, not in CI's limit.
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (timeout > 0 and math.isfinite(timeout))
    ):
        raise ValueError(
            "timeout must be a positive, finite number of seconds, got "
            f"{timeout!r}"
        )
    return float(timeout)


def _worker_context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server preloading torch and keras."""
    context = multiprocessing.get_context("forkserver")
    package = __name__.rpartition(".")[0]
    context.set_forkserver_preload([f"{package}.worker_preload".lstrip(".")])
    # Python 3.11's forkserver does not take our `sys.path`, yet it must
    # import the preload module and, in every worker, this one.
    here = _REPO_ROOT if package else os.path.dirname(__file__)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, saved]))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return context


def _worker_sys_path() -> list[str]:
    # Workers must import the body's module exactly as the parent did
    # (pytest's "importlib" import mode does not touch sys.path, so add
    # the repository root too).
    path = list(sys.path)
    if _REPO_ROOT not in path:
        path.append(_REPO_ROOT)
    return path


def _decode_reply(rank: int, data: bytes) -> RankOutcome:
    try:
        reply = pickle.loads(data)
    except Exception:
        return RankOutcome(
            rank,
            "error",
            detail="the parent could not unpickle the result:\n"
            + traceback.format_exc(),
        )
    kind, body = reply
    if kind in ("ok", "ready"):
        return RankOutcome(rank, "ok", value=body)
    return RankOutcome(rank, "error", detail=body)


def _format_failure(
    fn: Callable, world_size: int, timeout: float, outcomes: list[RankOutcome]
) -> str:
    summary = "; ".join(
        f"rank {o.rank} {_STATUS_WORDS[o.status]}" for o in outcomes
    )
    header = (
        f"{fn.__module__}.{fn.__qualname__} failed on {world_size} ranks "
        f"(timeout {timeout:g} s): {summary}"
    )
    return header + "\n" + _format_outcomes(outcomes)


_STATUS_WORDS = {
    "ok": "ok",
    "error": "raised",
    "died": "died",
    "timeout": "timed out (stuck)",
    "stopped": "stopped (no answer after another rank failed)",
}


def _format_outcomes(outcomes: list[RankOutcome]) -> str:
    sections = []
    for outcome in outcomes:
        title = f"===== rank {outcome.rank}: {outcome.status} ====="
        if outcome.status in ("timeout", "stopped"):
            title += " stacks at the deadline:"
        body = outcome.detail.rstrip() if not outcome.ok else ""
        sections.append(title + ("\n" + body if body else ""))
    return "\n".join(sections)


def _read_text(path: str) -> str:
    try:
        with open(path, errors="replace") as file:
            return file.read()
    except OSError:
        return ""


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _torchrun_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
    )
    if _has_loopback():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Scripts may import the project (e.g. `tests.harness`).
    python_path = [_REPO_ROOT] + env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(p for p in python_path if p)
    env.update(extra or {})
    return env


def _kill_process_tree(proc: subprocess.Popen) -> tuple[bytes, bytes]:
    """SIGABRT (stack dumps), then SIGKILL, `proc` and all descendants.

    torchrun starts each rank in a session of its own, so signalling our
    process group is not enough: walk the process tree instead (before
    the agent dies and its ranks get re-parented).
    """
    tree = [proc.pid] + _descendants(proc.pid)
    for sig, wait in ((signal.SIGABRT, 5), (signal.SIGKILL, 10)):
        tree += [pid for pid in _descendants(proc.pid) if pid not in tree]
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    # Something outside the tree still holds the pipes open.
    proc.kill()
    return proc.communicate()


def _descendants(pid: int) -> list[int]:
    """PIDs of all live descendants of `pid` (Linux /proc), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                # "pid (comm) state ppid ...": comm may contain spaces.
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # Exited meanwhile.
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def _output_tails(result: TorchrunResult, lines: int = 60) -> str:
    return (
        f"----- stdout (last {lines} lines) -----\n"
        f"{_tail(result.stdout, lines)}\n"
        f"----- stderr (last {lines} lines) -----\n"
        f"{_tail(result.stderr, lines)}"
    )


def _has_loopback() -> bool:
    return os.path.exists("/sys/class/net/lo")


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------

# Kept alive for the worker's lifetime: faulthandler writes to its fd.
_stack_file = None
# Settings captured after start-up, restored after every call.
_baseline: dict[str, Any] = {}


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    log_path: str,
    stack_path: str,
    sys_path: list[str],
    parent_pid: int,
) -> None:
    """Entry point of a worker: start-up, then serve calls until told."""
    _redirect_output(log_path)
    # Ctrl-C reaches the whole foreground process group: let the parent
    # handle it (it kills the pool) instead of every worker dying noisily.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    _install_stack_dumps(stack_path)
    _set_torchrun_env(rank, world_size, port)
    sys.path[:] = sys_path
    try:
        # Import first: the ranks then reach the rendezvous at about the
        # same time even on a loaded machine, well within its timeout.
        _import_torch_and_keras()
        _init_process_group(rank, world_size, port)
        _capture_baseline()
    except BaseException:
        _reply(conn, ("startup_error", traceback.format_exc()))
        os._exit(1)
    _reply(conn, ("ready", os.getpid()))
    _serve(conn, rank, world_size)
    _exit_cleanly(conn)


def _redirect_output(log_path: str) -> None:
    # fd-level, so that C++ output (gloo, torch warnings) is caught too.
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        if stream is not None:
            stream.flush()
        os.dup2(log_fd, fd)
    os.close(log_fd)


def _die_with_parent(parent_pid: int) -> None:
    # If pytest itself is killed, the workers must not linger (they would
    # sit in a collective up to PROCESS_GROUP_TIMEOUT first). Their parent
    # is the forkserver, which exits when pytest does.
    if not sys.platform.startswith("linux"):
        return
    server_pid = os.getppid()
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    # The server or pytest died before prctl.
    if os.getppid() != server_pid or not _process_alive(parent_pid):
        os._exit(1)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _install_stack_dumps(stack_path: str) -> None:
    global _stack_file
    # Append mode: the parent truncates the file before asking for a dump.
    _stack_file = open(stack_path, "a")
    # On a fatal signal (segfault, abort) and on request of the parent.
    faulthandler.enable(file=_stack_file, all_threads=True)
    faulthandler.register(
        _STACK_DUMP_SIGNAL, file=_stack_file, all_threads=True, chain=False
    )


def _set_torchrun_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        # Keras bounds collectives after the first step by this; keep ours.
        KERAS_DISTRIBUTION_TIMEOUT=str(int(PROCESS_GROUP_TIMEOUT)),
    )
    if _has_loopback():
        # Gloo would otherwise use the interface the hostname resolves to.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _init_process_group(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def _import_torch_and_keras() -> None:
    # Every test needs keras: pay its import once per pool. A broken
    # keras must not break bodies that don't use it, so only report it.
    import torch

    torch.set_num_threads(1)
    try:
        import keras

        # The first clear_session() imports torch._dynamo (seconds):
        # pay that here too, not in the first test.
        keras.backend.clear_session()
    except Exception:
        print(f"{__name__}: importing keras failed in the worker:")
        traceback.print_exc()


def _capture_baseline() -> None:
    import torch

    _baseline["environ"] = dict(os.environ)
    _baseline["cwd"] = os.getcwd()
    _baseline["torch_dtype"] = torch.get_default_dtype()
    keras = sys.modules.get("keras")
    if keras is not None:
        _baseline["keras_config"] = (
            keras.config.floatx(),
            keras.config.epsilon(),
            keras.config.image_data_format(),
        )
    # clear_session() runs gc.collect() after every call, which takes
    # ~0.2 s when it has to walk all of torch's and keras' objects: move
    # those out of the collector's sight (they live as long as we do).
    gc.collect()
    gc.freeze()


def _serve(conn: Connection, rank: int, world_size: int) -> None:
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # The parent is gone.
        if message[0] == "shutdown":
            return
        _reply(conn, _run_call(message[1], rank, world_size))


def _run_call(payload: bytes, rank: int, world_size: int) -> tuple:
    """Runs one body; returns the reply ("ok", value) or ("error", text)."""
    try:
        module, qualname, args, kwargs = pickle.loads(payload)
        fn = _resolve_function(module, qualname)
    except BaseException:
        return ("error", "could not load the body:\n" + traceback.format_exc())
    try:
        value = fn(rank, world_size, *args, **kwargs)
    except BaseException as error:  # SystemExit too: report, don't exit.
        _flush_output()
        # Start the traceback at the body, not at this frame.
        frames = error.__traceback__.tb_next
        return (
            "error",
            "".join(traceback.format_exception(type(error), error, frames)),
        )
    try:
        _reset_state()
    except BaseException:
        return (
            "error",
            "the body returned, but resetting the worker state failed:\n"
            + traceback.format_exc(),
        )
    finally:
        _flush_output()
    return ("ok", value)


def _resolve_function(module_name: str, qualname: str) -> Callable:
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _reset_state() -> None:
    """Undoes what a successful body may have changed globally."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        # Fail this call so that the pool is replaced: later bodies
        # rely on the default group.
        raise RuntimeError("the body destroyed the default process group")
    if os.environ != _baseline["environ"]:
        os.environ.clear()
        os.environ.update(_baseline["environ"])
    if os.getcwd() != _baseline["cwd"]:
        os.chdir(_baseline["cwd"])
    torch.set_default_dtype(_baseline["torch_dtype"])
    torch.set_default_device(None)
    torch.set_grad_enabled(True)
    _reset_keras()


def _reset_keras() -> None:
    keras = sys.modules.get("keras")
    if keras is None or "keras_config" not in _baseline:
        return
    set_distribution = getattr(
        getattr(keras, "distribution", None), "set_distribution", None
    )
    if set_distribution is not None:
        set_distribution(None)
    # Also resets the global dtype policy and the layer-name counters.
    keras.backend.clear_session()
    floatx, epsilon, data_format = _baseline["keras_config"]
    keras.config.set_floatx(floatx)
    keras.config.set_epsilon(epsilon)
    keras.config.set_image_data_format(data_format)


def _reply(conn: Connection, reply: tuple) -> None:
    try:
        data = pickle.dumps(reply)
    except Exception:
        data = pickle.dumps(
            (
                "error",
                "the result could not be pickled:\n" + traceback.format_exc(),
            )
        )
    try:
        conn.send_bytes(data)
    except OSError:
        os._exit(1)  # The parent is gone.


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


def _exit_cleanly(conn: Connection) -> None:
    # Destroy the group, then leave without interpreter teardown: torch's
    # C++ threads alive during teardown print "terminate called ...".
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        _flush_output()
        conn.close()
        os._exit(0)
