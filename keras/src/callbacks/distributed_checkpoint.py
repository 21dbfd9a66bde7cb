import warnings

from keras.src import backend
from keras.src.api_export import keras_export
from keras.src.backend.common.distribution_capability import (
    distribution_capability,
)
from keras.src.callbacks.monitor_callback import MonitorCallback
from keras.src.utils import io_utils


@keras_export("keras.callbacks.DistributedCheckpoint")
class DistributedCheckpoint(MonitorCallback):
    """Saves sharded checkpoints: every process writes its own shards.

    The counterpart of `OrbaxCheckpoint` for backends that write distributed
    checkpoints (torch). Each save is `directory/<step>/` (the epoch, or the
    batches seen), which appears only once complete.
    `model.load_weights(directory)` and `load_model(directory)` (with the
    optimizer's state) load the latest step on any mesh or process count.

    Example:

    ```python
    callback = keras.callbacks.DistributedCheckpoint(
        directory="/tmp/ckpt", save_freq=100, max_to_keep=3
    )
    model.fit(x, y, epochs=10, callbacks=[callback])
    callback.wait_until_finished()
    model = keras.saving.load_model("/tmp/ckpt")
    ```

    Args:
        directory: the checkpoints' directory, shared by all processes.
        monitor: the metric name to monitor (e.g. `"val_loss"`).
        verbose: verbosity mode, 0 or 1.
        save_best_only: whether to save only when the monitor improves.
        mode: one of `{"auto", "min", "max"}`, used with `save_best_only`.
        save_freq: `"epoch"` or an integer: save every this many batches.
        initial_value_threshold: the monitor's initial "best" value.
        max_to_keep: latest checkpoints kept (`None`: all). Defaults to 1.
        save_on_background: whether to write in the background, training on
            once the values are copied to host memory. Defaults to `True`.
        save_weights_only: whether to skip the optimizer state and config.
    """

    def __init__(
        self,
        directory,
        monitor="val_loss",
        verbose=0,
        save_best_only=False,
        mode="auto",
        save_freq="epoch",
        initial_value_threshold=None,
        max_to_keep=1,
        save_on_background=True,
        save_weights_only=False,
    ):
        make_checkpointer = distribution_capability("distributed_checkpointer")
        if make_checkpointer is None:
            raise ValueError(
                "`DistributedCheckpoint` needs a backend that writes "
                "distributed checkpoints, such as torch. Received: "
                f"backend={backend.backend()}. With JAX, use "
                "`keras.callbacks.OrbaxCheckpoint`."
            )
        if save_freq != "epoch" and (
            not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                "`save_freq` must be 'epoch' or a positive integer. "
                f"Received: save_freq={save_freq}"
            )
        super().__init__(monitor, mode, initial_value_threshold)
        self.directory = directory
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_freq = save_freq
        self.max_to_keep = max_to_keep
        self.save_on_background = save_on_background
        self.save_weights_only = save_weights_only
        self._checkpointer = make_checkpointer(directory, max_to_keep)
        self._batches_seen_since_last_saving = 0
        self._last_batch_seen = None
        self._total_batches_seen = 0

    def set_model(self, model):
        super().set_model(model)
        if getattr(model, "optimizer", None) is not None:
            # A reloaded model goes on counting from its iterations.
            self._total_batches_seen = int(model.optimizer.iterations)

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch":
            return
        last, self._last_batch_seen = self._last_batch_seen, batch
        # Past the last batch seen, or of a new epoch.
        seen = batch - last if last is not None and batch > last else batch + 1
        self._total_batches_seen += seen
        self._batches_seen_since_last_saving += seen
        if self._batches_seen_since_last_saving >= self.save_freq:
            self._batches_seen_since_last_saving = 0
            self._save_if_best(self._total_batches_seen, logs, "batch", batch)

    def on_epoch_end(self, epoch, logs=None):
        if self.monitor_op is None:
            self._set_monitor_op()
        if self.save_freq == "epoch":
            self._save_if_best(epoch, logs, "epoch", epoch)

    def on_train_end(self, logs=None):
        self.wait_until_finished()

    def wait_until_finished(self):
        """Waits for the background save to complete; every process calls it."""
        self._checkpointer.wait()

    def _save_if_best(self, step, logs, unit, index):
        if self.save_best_only:
            if self.monitor_op is None:
                self._set_monitor_op()
            current = (logs or {}).get(self.monitor)
            if current is None:
                warnings.warn(
                    f"Can save best model only with {self.monitor} "
                    f"available, skipping save at {unit} {index}.",
                    stacklevel=2,
                )
                return
            if not self._is_improvement(current, self.best):
                return
            self.best = current
        if self.verbose > 0:
            io_utils.print_msg(
                f"\n{unit.capitalize()} {index}: saving checkpoint {step} "
                f"to {self.directory}"
            )
        self._checkpointer.save(
            self.model, step, self.save_weights_only, self.save_on_background
        )
