"""Jobs that `tests/test_cuda.py` runs under torchrun on a CUDA machine.

Each job joins its process group with `keras.distribution.initialize()`
(NCCL for CUDA tensors, gloo beside it, one GPU per process) and writes
what it found for the test to judge::

    torchrun --standalone --nproc-per-node=1 tests/cuda_jobs.py \\
        catalogue MODE OUT_DIR [CASE ...]
    torchrun --standalone --nproc-per-node=1 tests/cuda_jobs.py \\
        training OUT_FILE

* `catalogue`: the layer catalogue's cases (`tests/layer_catalogue.py`,
  default all) under one of its modes, each result written to `OUT_DIR`
  as the catalogue's own runs write them.
* `training`: the parity zoo (`tests/parity_models.py`) fitted with no
  distribution, with `DataParallel` and with `ModelParallel`, with the
  device of every variable; the compiled step (`jit_compile=True`); a
  `DistributedCheckpoint` saved in the background and loaded into a model
  with no distribution.
"""

import os
import pickle
import sys
import tempfile

import numpy as np

# A plain `python tests/cuda_jobs.py` puts tests/ first on sys.path, not
# the repository.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The settings the training job compares to one process with none.
TRAINING_SETTINGS = ("dp", "mp")
# The models the compiled step trains (each compiles once per setting).
COMPILED_KINDS = ("mlp", "batchnorm")


def run_catalogue(mode, out_dir, names):
    """Runs the layer catalogue's cases `names` under `mode`."""
    import torch.distributed as dist

    import keras
    from tests import layer_catalogue

    keras.distribution.initialize()
    layer_catalogue.run_cases(
        dist.get_rank(),
        names or list(layer_catalogue.CASES),
        out_dir,
        lambda name: layer_catalogue.guarded_run(name, mode),
        case_timeout=layer_catalogue.CASE_TIMEOUT,
    )


def _fit(kind, setting, *, jit_compile=False):
    """Fits parity model `kind` under `setting`; its state and devices."""
    import keras
    from tests import distributions
    from tests import layer_catalogue
    from tests import parity_models

    distributions.use_setting(
        setting, layout_rules=parity_models.LAYOUT_RULES[kind]
    )
    try:
        model = parity_models.build_model(kind, jit_compile=jit_compile)
        x, y = parity_models.make_data(kind, num_samples=24)
        history = model.fit(
            x, y, batch_size=8, epochs=2, shuffle=False, verbose=0
        )
        result = parity_models.fit_result(model, history)
        result["devices"] = layer_catalogue.variable_devices(
            list(model.weights) + list(model.optimizer.variables)
        )
        return result
    finally:
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()


def _checkpoint_round_trip(directory):
    """Fits the attention model under `ModelParallel` with a background
    `DistributedCheckpoint`, loads the checkpoint into the same model built
    with no distribution; both models' weights."""
    import keras
    from tests import distributions
    from tests import layer_catalogue
    from tests import parity_models

    kind = "attention"
    distributions.use_setting(
        "mp", layout_rules=parity_models.LAYOUT_RULES[kind]
    )
    model = parity_models.build_model(kind)
    x, y = parity_models.make_data(kind, num_samples=24)
    checkpoint = keras.callbacks.DistributedCheckpoint(
        directory, save_freq="epoch", save_on_background=True
    )
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[checkpoint],
    )
    trained = [np.array(w) for w in model.get_weights()]
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    restored = parity_models.build_model(kind)
    restored.load_weights(directory)
    loaded = [np.array(w) for w in restored.get_weights()]
    devices = layer_catalogue.variable_devices(restored.weights)
    keras.backend.clear_session()
    return {"trained": trained, "loaded": loaded, "devices": devices}


def run_training(out_file):
    """The training job: see the module docstring."""
    import keras

    keras.distribution.initialize()
    from tests import parity_models

    results = {}
    for kind in parity_models.MODEL_KINDS:
        for setting in ("single",) + TRAINING_SETTINGS:
            results[f"{kind}/{setting}"] = _fit(kind, setting)
    for kind in COMPILED_KINDS:
        results[f"{kind}/dp/jit"] = _fit(kind, "dp", jit_compile=True)
    with tempfile.TemporaryDirectory(prefix="cuda-checkpoint-") as directory:
        results["checkpoint"] = _checkpoint_round_trip(directory)
    with open(out_file + ".tmp", "wb") as file:
        pickle.dump(results, file)
    os.replace(out_file + ".tmp", out_file)


def main(argv):
    job, *args = argv
    if job == "catalogue":
        mode, out_dir, *names = args
        run_catalogue(mode, out_dir, names)
    elif job == "training":
        (out_file,) = args
        run_training(out_file)
    else:
        raise ValueError(
            f"Unknown job {job!r}: expected 'catalogue' or 'training'."
        )


if __name__ == "__main__":
    main(sys.argv[1:])
