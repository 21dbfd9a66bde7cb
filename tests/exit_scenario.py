"""A rank that exits right after many collectives.

Run by `test_clean_exit.py` under torchrun: the process group is
`keras.distribution`'s, and a device mesh outlives it (a module global, as
in a training script), so gloo's worker threads live on after the group is
destroyed. Without `keras.distribution`'s clean-up at exit (`--no-cleanup`)
such an exit aborts in about 1 run in 3 (torch 2.13).

With `--user-destroys`, the script trains a step under `DataParallel` and
destroys the process group itself before it returns, as many training
scripts do: what `keras.distribution` runs at exit must not need it.
"""

import atexit
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import keras
from keras.src.backend.torch import distribution_lib
from keras.src.backend.torch.distributed.core import runtime


def main():
    torch.set_num_threads(1)
    keras.distribution.initialize()
    if "--no-cleanup" in sys.argv:
        # How the test knows it can fail: the exit without the clean-up.
        atexit.unregister(runtime._destroy_process_group)
    global mesh
    mesh = keras.distribution.DeviceMesh(
        (dist.get_world_size(),), ["batch"], keras.distribution.list_devices()
    )
    group = distribution_lib._to_backend_mesh(mesh).get_group(0)
    for _ in range(200):
        gathered = [torch.empty(1000) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.ones(1000), group=group)
    if "--user-destroys" in sys.argv:
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
        model.train_on_batch(np.ones((4, 4)), np.ones((4, 2)))
        dist.destroy_process_group()
    print(f"rank {os.environ['RANK']} returns", flush=True)


if __name__ == "__main__":
    main()
