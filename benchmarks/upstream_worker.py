"""A training-step server on pristine Keras, in its own process.

`upstream_runners` starts this script with the pristine Keras tree first on
`PYTHONPATH` (pristine and patched Keras cannot share a process) and sends
it pickled requests on stdin; each answer is pickled on stdout:

* `("init", kind, shapes, ref, x, y, threads, math_sdpa)` builds the model
  with the reference weights; answers `keras.__file__`;
* `("step",)` runs one training step (`model.train_function`, as
  `keras_runners` does); answers `(wall_s, cpu_s, loss)`, timed here so
  the pipe's round trip is not counted;
* `("exit",)` ends the process.
"""

import contextlib
import os
import pickle
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch  # noqa: E402
from bench_models import keras_model  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

import keras  # noqa: E402


def build(kind, shapes, ref, x, y, threads):
    """Keras' own train step of `kind`, ready to run on `(x, y)`."""
    torch.set_num_threads(threads)
    model = keras_model(kind, shapes)
    model.set_weights([ref[v.path] for v in model.weights])
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-3), loss="mse"
    )
    model.make_train_function()
    train_function = model.train_function
    batch = [(x, y, None)]
    return lambda: train_function(batch)


def serve(requests, answers):
    step, math_sdpa = None, False
    while True:
        request = pickle.load(requests)
        if request[0] == "exit":
            return
        if request[0] == "init":
            *build_args, math_sdpa = request[1:]
            step = build(*build_args)
            answer = keras.__file__
        else:
            context = contextlib.nullcontext()
            if math_sdpa:
                context = sdpa_kernel([SDPBackend.MATH])
            start, cpu_start = time.perf_counter(), time.process_time()
            with context:
                logs = step()
            loss = float(keras.ops.convert_to_numpy(logs["loss"]))
            answer = (
                time.perf_counter() - start,
                time.process_time() - cpu_start,
                loss,
            )
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    # Answers go to the original stdout only; anything printed goes to
    # stderr.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr
    serve(sys.stdin.buffer, answers)
