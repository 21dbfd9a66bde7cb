"""A job in which process 0 makes a collective call the others may not make.

Run by `tests/test_one_sided_calls.py` under torchrun:

    python tests/one_sided_call_scenario.py SCENARIO OUT_DIR

Scenarios (`ModelParallel`, kernels split over the `model` axis):
- `read_then_exit`: process 0 reads `model.get_weights()`; the others
  sleep 2 s and exit.
- `read_then_fit`: process 0 reads `model.get_weights()`; then every
  process compiles and fits.
- `callback_read`: every process fits; a callback reads the kernel on
  process 0 only, at the end of the third batch.
- `read_while_busy`: process 0 reads; the others compute for 20 s (no
  collective) and exit: process 0 waits for the job's timeout.
- `read_everywhere`: every process reads the weights (in a callback during
  `fit` too), saves them, predicts and reads a metric, and writes what it
  read to `OUT_DIR/result.rank<N>.json`.

Each process says (prints, and writes to `OUT_DIR/outcome.rank<N>.txt`)
`READY <rank> <time>` when its scenario starts, `RAISED <rank> <type> after
<seconds> s: <message>` for an error that ends it, and `DONE <rank>
<seconds>` when its scenario completes.
"""

import json
import os
import sys
import tempfile
import time

import numpy as np

import keras
from keras import distribution as kd

RANK = int(os.environ["RANK"])


def _model():
    mesh = kd.DeviceMesh(
        (1, int(os.environ["WORLD_SIZE"])),
        ["batch", "model"],
        kd.list_devices(),
    )
    layout_map = kd.LayoutMap(mesh)
    layout_map[".*kernel"] = (None, "model")
    kd.set_distribution(
        kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 8)), rng.normal(size=(64, 8))


class _ReadKernel(keras.callbacks.Callback):
    def __init__(self, ranks, batch):
        super().__init__()
        self.ranks, self.batch, self.read = ranks, batch, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch and RANK in self.ranks:
            self.read = self.model.layers[0].kernel.numpy()


def read_then_exit(model):
    if RANK == 0:
        model.get_weights()
    else:
        time.sleep(2)


def read_then_fit(model):
    if RANK == 0:
        model.get_weights()
    model.fit(*_data(), batch_size=16, epochs=1, verbose=0)


def callback_read(model):
    callback = _ReadKernel(ranks=(0,), batch=2)
    model.fit(*_data(), batch_size=8, epochs=2, callbacks=[callback], verbose=0)


def read_while_busy(model):
    if RANK == 0:
        model.get_weights()
    else:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            np.linalg.svd(np.ones((64, 64)))


def read_everywhere(model):
    before = [w.tolist() for w in model.get_weights()]
    callback = _ReadKernel(ranks=range(int(os.environ["WORLD_SIZE"])), batch=1)
    history = model.fit(
        *_data(), batch_size=16, epochs=2, callbacks=[callback], verbose=0
    )
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.weights.h5")
        if RANK == 0:
            # Every process passes the same path; one writes it.
            os.makedirs(directory, exist_ok=True)
        model.save_weights(path)
    prediction = model.predict(_data()[0][:16], verbose=0)
    # A file per process: long lines of several processes sharing one
    # pipe can interleave.
    path = os.path.join(sys.argv[2], f"result.rank{RANK}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "rank": RANK,
                "before": before,
                "in_callback": callback.read.tolist(),
                "after": [w.tolist() for w in model.get_weights()],
                "kernel_shape": list(model.layers[0].kernel.value.shape),
                "loss": history.history["loss"],
                "metrics": {
                    k: float(v) for k, v in model.get_metrics_result().items()
                },
                "prediction": prediction.tolist(),
            },
            f,
        )


def _say(line):
    """Prints `line`, and appends it to this process' outcome file (the
    lines of several processes sharing one pipe can interleave)."""
    print(line, flush=True)
    path = os.path.join(sys.argv[2], f"outcome.rank{RANK}.txt")
    with open(path, "a") as f:
        f.write(line + "\n")


def main():
    scenario = globals()[sys.argv[1]]
    kd.initialize()
    model = _model()
    _say(f"READY {RANK} {time.time()}")
    start = time.monotonic()
    try:
        scenario(model)
    except Exception as error:
        message = " ".join(str(error).split())
        _say(
            f"RAISED {RANK} {type(error).__name__} after "
            f"{time.monotonic() - start:.1f} s: {message}"
        )
        raise
    _say(f"DONE {RANK} {time.monotonic() - start:.1f}")


if __name__ == "__main__":
    main()
