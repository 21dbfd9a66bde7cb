"""One process of a 2-process job that goes wrong on purpose.

Run by `tests/test_job_failures.py`, one process per rank, started as two
"nodes" would start them (no torchrun agent): `RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT` point at a store the test owns.

    python tests/job_scenarios.py SCENARIO MARK_FILE

`MARK_FILE`: where process 1 writes the time at which it misbehaves.
"""

import os
import signal
import sys
import time

import numpy as np

import keras
from keras import distribution as kd

# Process 1 misbehaves at the end of this train batch (the first step has
# completed: collectives are bounded by the step timeout).
FAILING_BATCH = 2


class _Misbehave(keras.callbacks.Callback):
    def __init__(self, action, mark_file):
        super().__init__()
        self.action = action
        self.mark_file = mark_file

    def on_train_batch_end(self, batch, logs=None):
        if os.environ["RANK"] != "1" or batch != FAILING_BATCH:
            return
        with open(self.mark_file, "w") as f:
            f.write(str(time.time()))
        if self.action == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "die":
            os._exit(3)
        elif self.action == "raise":
            raise ValueError("boom from a callback on process 1")


def _model():
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)]
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


def _fit(model, callbacks=()):
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = x[:, :1]
    model.fit(
        x, y, batch_size=8, epochs=1, verbose=0, callbacks=list(callbacks)
    )


def main(scenario, mark_file):
    if scenario not in ("freeze", "die", "raise"):
        raise AssertionError(f"unknown scenario {scenario}")
    kd.set_distribution(kd.DataParallel())
    _fit(_model(), callbacks=[_Misbehave(scenario, mark_file)])
    print(f"scenario {scenario} ended without error")


if __name__ == "__main__":
    main(*sys.argv[1:])
