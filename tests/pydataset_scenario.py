"""A `PyDataset` that reshuffles its rows at each epoch's end, fitted.

Run by `tests/test_pydataset_parity.py` in two ways: as a script in a
fresh interpreter with pristine Keras 3.15.1 first on `PYTHONPATH` (one
process, no distribution), printing its result as JSON:

    python tests/pydataset_scenario.py '{"workers": 2}'

(the arguments of `fit`, as JSON)
and through `fit` in the multi-rank workers, under a distribution. Only
numpy and keras are imported: the script runs against either package.
"""

import json
import sys

import numpy as np

import keras

NUM_SAMPLES = 112  # 14 batches of 8: more than a queue of 10 reads ahead.
BATCH = 8
EPOCHS = 3
SEED = 7
# The "2x2" setting's layouts: both kernels split on the model axis.
LAYOUT_RULES = {
    "hidden/kernel": (None, "model"),
    "hidden/bias": ("model",),
    "out/kernel": ("model", None),
}


class ReshuffledRows(keras.utils.PyDataset):
    """Batches of a seeded array; its own RNG reshuffles the rows.

    Each batch depends on the order the last `on_epoch_end` drew, so the
    losses tell which epoch's order every batch was read in.
    """

    def __init__(self, x, y, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y = x, y
        self.rng = np.random.default_rng(SEED)
        self.rows = self.rng.permutation(len(x))

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        rows = self.rows[index * BATCH : (index + 1) * BATCH]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.rows = self.rng.permutation(len(self.x))


def make_data():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1.0, 1.0, size=(NUM_SAMPLES, 5)).astype("float32")
    y = np.stack([x.sum(-1), x[:, 0] * x[:, -1], np.abs(x).mean(-1)], -1)
    return x, y.astype("float32")


def fit(
    workers, use_multiprocessing=False, max_queue_size=10, steps_per_epoch=None
):
    """Fits a seeded MLP on `ReshuffledRows`; evaluates on it.

    The `PyDataset` is read with `workers`, `use_multiprocessing` and
    `max_queue_size`; `steps_per_epoch` (None: the whole dataset) may end
    epochs within a pass over the dataset.

    Returns:
        `{"loss": per-epoch losses, "evaluate": loss, "weights": [...]}`.
    """
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(31, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="out")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    dataset = ReshuffledRows(
        *make_data(),
        workers=workers,
        use_multiprocessing=use_multiprocessing,
        max_queue_size=max_queue_size,
    )
    history = model.fit(
        dataset,
        epochs=EPOCHS,
        steps_per_epoch=steps_per_epoch,
        shuffle=True,
        verbose=0,
    )
    return {
        "loss": history.history["loss"],
        "evaluate": model.evaluate(dataset, verbose=0),
        "weights": [np.array(w).tolist() for w in model.get_weights()],
    }


def settle_enqueuer_stops():
    """Keras' enqueuer stops where it does on an idle machine.

    `stop()` keeps what the enqueuer's thread has queued, and that thread
    runs ahead of the steps: on an idle machine it waits on a full queue
    (or has queued the whole order) whenever an epoch ends, and pristine
    Keras gives the same numbers run after run. On a loaded one it may lag
    behind and keep fewer batches. This waits for that thread first (the
    waiting is timing only: Keras' logic is unchanged).
    """
    import time

    from keras.src.trainers.data_adapters import py_dataset_adapter

    enqueuer = py_dataset_adapter.PyDatasetEnqueuer
    stop = enqueuer.stop

    def settled_stop(self, drain_queue_and_join=True):
        thread = self.run_thread
        while (
            self.running
            and thread is not None
            and thread.is_alive()
            # CPython's `Condition`: a thread waits to put into the queue.
            and not self.future_queue.not_full._waiters
        ):
            time.sleep(0.001)
        stop(self, drain_queue_and_join)

    enqueuer.stop = settled_stop


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    settle_enqueuer_stops()
    result = fit(**json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result))
