"""Imports what every multi-rank worker needs, once, in the forkserver.

`tests/harness.py` forks its workers from a multiprocessing forkserver that
has imported this module: a new worker then starts with torch and keras
imported, instead of importing them itself (seconds of CPU per worker, paid
again at every pool start, e.g. after each failed call). It sets what the
workers set before importing torch: the Keras backend and one thread.
"""

import os

os.environ["KERAS_BACKEND"] = "torch"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)
try:
    # `keras.backend.clear_session()` imports dynamo at a worker's start.
    import torch._dynamo  # noqa: E402, F401

    import keras  # noqa: E402, F401
except Exception:
    # The worker imports keras again and reports what went wrong there.
    pass
