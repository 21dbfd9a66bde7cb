"""How long a small all-reduce takes after each process computed for a while.

A data-parallel step is CPU work followed by collectives. On a machine whose
cores are all busy (the processes' main threads), the collective's own threads
wait for the scheduler, and that wait can grow with the work that came
before, the same for any library. This measures it, so that step ratios
between two implementations doing different amounts of work per step can be
read: each process computes for W ms (small matrix products), then
all-reduces 700 floats (a small model's gradients); medians and 90th
percentiles of the all-reduce alone, on process 0, per W. The same with the
all-reduce launched asynchronously and waited at once.

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/bench_collective_latency.py
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--work-ms", type=float, nargs="+", default=[0, 1, 2, 3, 4, 6]
    )
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--floats", type=int, default=700)
    return parser.parse_args()


def _compute(milliseconds, matrix):
    end = time.perf_counter() + milliseconds / 1e3
    while time.perf_counter() < end:
        matrix @ matrix


def _latencies(milliseconds, repeats, buffer, matrix, async_op):
    times = []
    for _ in range(repeats):
        _compute(milliseconds, matrix)
        start = time.perf_counter()
        work = dist.all_reduce(buffer, async_op=async_op)
        if async_op:
            work.wait()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return statistics.median(times), times[int(0.9 * len(times))]


def main():
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    buffer, matrix = torch.zeros(args.floats), torch.randn(64, 64)
    for _ in range(50):
        dist.all_reduce(buffer)
    rows = []
    for milliseconds in args.work_ms:
        for async_op in (False, True):
            median, p90 = _latencies(
                milliseconds, args.repeats, buffer, matrix, async_op
            )
            rows.append((milliseconds, async_op, median, p90))
    if dist.get_rank() == 0:
        print(
            f"{dist.get_world_size()} processes, {args.floats} floats, "
            f"{args.repeats} all-reduces per row, gloo, one thread each"
        )
        print("work ms  launch  median ms  p90 ms")
        for milliseconds, async_op, median, p90 in rows:
            launch = "async" if async_op else "sync"
            print(f"{milliseconds:7g}  {launch:6s}  {median:9.2f}  {p90:6.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
