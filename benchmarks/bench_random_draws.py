"""What a random draw by position costs against torch's own dropout.

One process, no launcher needed::

    python benchmarks/bench_random_draws.py [--device cuda]

Under a distribution the torch backend draws each element from its
position (`random_draws`): a process draws only its share, and any layout
draws the same numbers. This measures, side by side in one run, medians of
`--rounds` rounds of `--repeats` calls, for tensors of each size in
`--sizes` (elements of one process' share):

- dropout by position (`random_draws.dropout`) against
  `torch.nn.functional.dropout` (torch's generator, which cannot be cut
  into parts);
- a uniform draw by position against `torch.rand`;
- a normal draw by position against `torch.randn`.

With `--device cuda` every call is followed by a synchronization. Prints
one line per size and measure with the ratio to torch.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch  # noqa: E402

from keras.src.backend.torch.distributed.core import counter_draws  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes",
        default="65536,262144,1048576,4194304",
        help="comma-separated numbers of elements",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--rounds", type=int, default=5, help="rounds (median)")
    p.add_argument("--repeats", type=int, default=10, help="calls a round")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    return p.parse_args()


def _median_seconds(function, args):
    synchronize = (
        torch.cuda.synchronize if args.device.startswith("cuda") else None
    )
    function()  # Warm-up: allocator, kernels.
    rounds = []
    for _ in range(args.rounds):
        if synchronize:
            synchronize()
        start = time.perf_counter()
        for _ in range(args.repeats):
            function()
        if synchronize:
            synchronize()
        rounds.append((time.perf_counter() - start) / args.repeats)
    return statistics.median(rounds)


def _measures(size, device):
    x = torch.ones(size, device=device)
    key = torch.tensor(12345, device=device)
    box = ((size,), (0,), (size,))

    def ours_dropout():
        # The factor `random_draws.dropout` multiplies by on this device.
        if device.type == "cpu":
            factor = counter_draws.keep_scale(key, box, device, 0.9, x.dtype)
        else:
            factor = counter_draws.keep_mask(key, box, device, 0.9)
        return counter_draws.masked_product(x, factor, 0.9)

    return [
        (
            "dropout",
            ours_dropout,
            lambda: torch.nn.functional.dropout(x, 0.1, training=True),
        ),
        (
            "uniform",
            lambda: counter_draws.unit_uniform(key, box, device, torch.float32),
            lambda: torch.rand(size, device=device),
        ),
        (
            "normal",
            lambda: counter_draws.standard_normal(
                key, box, device, torch.float32
            ),
            lambda: torch.randn(size, device=device),
        ),
    ]


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device: {device}, threads: {args.threads}")
    for size in (int(s) for s in args.sizes.split(",")):
        for name, ours, theirs in _measures(size, device):
            ours_s = _median_seconds(ours, args)
            theirs_s = _median_seconds(theirs, args)
            print(
                f"{name} {size}: by position {ours_s * 1e3:.3f} ms, "
                f"torch {theirs_s * 1e3:.3f} ms, "
                f"ratio {ours_s / theirs_s:.2f}x"
            )


if __name__ == "__main__":
    main()
