"""A 2-process training job under torchrun that may lose a process.

Run by `tests/test_resume.py`:

    torchrun --max-restarts=1 ... tests/resume_scenario.py BACKUP_DIR OUT KILL

With `KILL=1`, process 1 kills itself (SIGKILL) in the middle of epoch
`KILLED_EPOCH` of the first attempt; torchrun restarts the job and
`BackupAndRestore` resumes it. Process 0 writes each epoch's loss (the
last attempt's value wins) and the final weights to `OUT` (`.npz`).
"""

import json
import os
import signal
import sys

import numpy as np

import keras
from keras import distribution as kd

EPOCHS = 4
KILLED_EPOCH = 2
KILLED_BATCH = 3


class _KillOnce(keras.callbacks.Callback):
    """Process 1 of the first attempt dies in the middle of an epoch."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (
            os.environ["RANK"] == "1"
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            and (self.epoch, batch) == (KILLED_EPOCH, KILLED_BATCH)
        ):
            os.kill(os.getpid(), signal.SIGKILL)


class _RecordLosses(keras.callbacks.Callback):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        if os.environ["RANK"] != "0":
            return
        losses = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                losses = json.load(f)
        losses[str(epoch)] = float(logs["loss"])
        with open(self.path, "w") as f:
            json.dump(losses, f)


def main(backup_dir, out, kill):
    keras.utils.set_random_seed(0)
    kd.set_distribution(kd.DataParallel())
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
    callbacks = [
        keras.callbacks.BackupAndRestore(backup_dir),
        _RecordLosses(out + ".losses.json"),
    ]
    if kill == "1":
        callbacks.append(_KillOnce())
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    weights = [np.asarray(w) for w in model.get_weights()]
    if os.environ["RANK"] == "0":
        np.savez(out, *weights)


if __name__ == "__main__":
    main(*sys.argv[1:])
