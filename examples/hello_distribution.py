"""Prints, per process, who it is and which devices Keras sees.

Run it on every GPU (or on 2 CPU processes with gloo when there is none):

    ./run_multi_gpu.sh examples/hello_distribution.py

Each rank prints one line, e.g.
``process 1 of 2 (pid 4242): devices ['cpu:0', 'cpu:1']``.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
from keras.src.backend import distribution_lib  # noqa: E402


def main():
    # torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR...) says it all.
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    # One write per line: the ranks share stdout, and print() may write the
    # text and its newline separately (unbuffered), letting lines interleave.
    sys.stdout.write(
        f"process {distribution_lib.process_id()} of "
        f"{distribution_lib.num_processes()} (pid {os.getpid()}): "
        f"devices {devices}\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
