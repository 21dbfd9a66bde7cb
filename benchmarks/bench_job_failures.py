"""A failing process: Keras' job health against torchelastic's error files.

One process of a 2-process data-parallel job goes wrong at its 4th step (it
raises, dies, or freezes) and the job runs to its end. Side by side in one
run: the same small MLP as a plain torch DDP job whose `main` is wrapped in
torchelastic's `@record` (the error files torchrun reports), and as a Keras
`DataParallel` job relying on Keras' own health checks; each launched as
one `torchrun` node of 2 processes, and as two single-process `torchrun`
nodes (two machines: no agent sees both processes). Both bound a collective
by the same `--timeout` (torch's process group timeout; Keras'
`KERAS_DISTRIBUTION_TIMEOUT`).

Per case it prints the seconds from the misbehaviour to the end of the
surviving side's launcher (the only one, or node 0's on two nodes: a frozen
process' own launcher waits on it forever), whether that launcher's output
names process 1 as the one that failed first (Keras' message, or
torchrun's root cause), and whether it shows the raised error; medians
over `--repeats`, the other columns as counts of runs.

    python benchmarks/bench_job_failures.py [--timeout 10] [--repeats 1]
"""

import argparse
import datetime
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

STEPS = 8
FAILING_STEP = 3
ERROR = "ValueError: boom on process 1"
JOBS = ("torch_ddp_record", "keras_data_parallel")
SCENARIOS = ("raise", "die", "freeze")
LAUNCHES = ("one_node", "two_nodes")
# Keras' message naming process 1, and torchrun's summary of the first
# failure (its "Root Cause" section) naming it.
_KERAS_NAMES_PROCESS_1 = "process 1 of 2"
_ROOT_CAUSE = "Root Cause (first observed failure):"
_TORCHRUN_RANK_1 = "rank      : 1"


def _misbehave(scenario, mark_file, step):
    if os.environ["RANK"] != "1" or step != FAILING_STEP:
        return
    with open(mark_file, "w") as f:
        f.write(str(time.time()))
    if scenario == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif scenario == "die":
        os._exit(3)
    raise ValueError("boom on process 1")


def _torch_job(scenario, mark_file, timeout):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(STEPS * 8, 8)
    rank, size = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        rows = x[step * 8 : (step + 1) * 8].chunk(size)[rank]
        loss = torch.nn.functional.mse_loss(model(rows), rows[:, :1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        _misbehave(scenario, mark_file, step)
    dist.destroy_process_group()


def _keras_job(scenario, mark_file, timeout):
    import numpy as np
    import torch

    import keras

    torch.set_num_threads(1)

    class Misbehave(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            _misbehave(scenario, mark_file, batch)

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)]
    )
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(STEPS * 8, 8)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, verbose=0, callbacks=[Misbehave()])


def _worker(job, scenario, mark_file, timeout):
    if job == "torch_ddp_record":
        from torch.distributed.elastic.multiprocessing.errors import record

        record(_torch_job)(scenario, mark_file, timeout)
    else:
        _keras_job(scenario, mark_file, timeout)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launchers(job, scenario, launch, mark_file, timeout, log_dir):
    """Starts the case's torchrun launcher(s); returns `(process, log)`s."""
    worker = [__file__, "--worker", job, scenario, mark_file, str(timeout)]
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="1",
        KERAS_DISTRIBUTION_TIMEOUT=str(timeout),
    )
    run = [sys.executable, "-m", "torch.distributed.run", "--max-restarts=0"]
    if launch == "one_node":
        commands = [run + ["--standalone", "--nproc-per-node=2"] + worker]
    else:
        endpoint = f"127.0.0.1:{_free_port()}"
        commands = [
            run
            + [
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
            ]
            + worker
            for node in (0, 1)
        ]
    launched = []
    for i, command in enumerate(commands):
        log = os.path.join(log_dir, f"{job}.{scenario}.{launch}.{i}.log")
        with open(log, "w") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        launched.append((process, log))
    return launched


def run_case(job, scenario, launch, timeout, bound):
    """One case: `(seconds to the end, names process 1, shows the error)`;
    seconds `None` where a launcher still ran after `bound` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        mark_file = os.path.join(tmp, "mark")
        launched = _launchers(job, scenario, launch, mark_file, timeout, tmp)
        # The surviving side's launcher: the only one, or node 0's (on two
        # nodes a frozen process' own launcher waits on it forever).
        survivor = launched[0][0]
        deadline = time.time() + bound
        while time.time() < deadline and survivor.poll() is None:
            time.sleep(0.1)
        ended = time.time()
        hung = survivor.poll() is None
        for process, _ in launched:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if not os.path.exists(mark_file):
            raise RuntimeError(
                f"{job} {scenario} {launch}: process 1 never misbehaved:\n"
                + open(launched[0][1]).read()[-3000:]
            )
        with open(mark_file) as f:
            seconds = None if hung else ended - float(f.read())
        # The surviving side's view: the first launcher (node 0).
        with open(launched[0][1]) as f:
            output = f.read()
    return seconds, _names_process_1(output), ERROR in output


def _names_process_1(output):
    """Whether `output` says process 1 failed first: Keras' message, or
    torchrun's root cause."""
    root_cause = output.partition(_ROOT_CAUSE)[2].split("=" * 20)[0]
    return (
        _KERAS_NAMES_PROCESS_1 in output.lower()
        or _TORCHRUN_RANK_1 in root_cause
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--launches", default=",".join(LAUNCHES))
    parser.add_argument("--worker", nargs=4)
    args = parser.parse_args()
    if args.worker:
        job, scenario, mark_file, timeout = args.worker
        _worker(job, scenario, mark_file, int(timeout))
        return
    bound = 10 * args.timeout + 120
    print(
        f"collectives bounded by {args.timeout} s; median of {args.repeats}\n"
        "| job | launch | scenario | s to the end | names process 1 "
        "| shows the error |\n| --- | --- | --- | --- | --- | --- |"
    )
    for scenario in args.scenarios.split(","):
        for launch in args.launches.split(","):
            for job in JOBS:
                runs = [
                    run_case(job, scenario, launch, args.timeout, bound)
                    for _ in range(args.repeats)
                ]
                times = [r[0] for r in runs if r[0] is not None]
                took = (
                    f"{statistics.median(times):.1f}"
                    if len(times) == len(runs)
                    else f"> {bound} (hung)"
                )
                names = f"{sum(r[1] for r in runs)}/{len(runs)}"
                shows = f"{sum(r[2] for r in runs)}/{len(runs)}"
                if scenario != "raise":
                    shows = "-"  # Nothing raised.
                print(
                    f"| {job} | {launch} | {scenario} | {took} | {names} "
                    f"| {shows} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
