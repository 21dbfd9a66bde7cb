"""The distributions the tests set up: one function per kind.

Every test that needs a `keras.distribution` gets it from here, so that
"data parallel", "model parallel on a (1, N) mesh" and the named settings
of the parity tests are built the same way everywhere. Tests whose point
is the construction API itself (e.g. a mesh that must be refused) may
still build theirs by hand.

Functions named `use_...` set the distribution for the process
(`keras.distribution.set_distribution`) and return it; the others only
build. In a multi-rank body every rank must make the same calls.

Named settings (`use_setting`):
    "single": no distribution.
    "dp": `DataParallel` over all devices.
    "mp": `ModelParallel` on a (1, N) ("batch", "model") mesh of all N
        devices: the model axis splits, the batch axis does not.
    "2x2": `ModelParallel` on a (2, 2) ("batch", "model") mesh; 4 devices.

Layout rules are a dict of `LayoutMap` key (a path regex) -> axes tuple,
e.g. `{"dense/kernel": (None, "model"), "dense/bias": ("model",)}`.
"""

# keras is imported inside the functions, like in `tests.parity_models`:
# importing this module must not pick a Keras backend.

AXIS_NAMES = ("batch", "model")
SETTINGS = ("single", "dp", "mp", "2x2")


def device_mesh(shape, *, axis_names=None, devices=None):
    """Returns a `keras.distribution.DeviceMesh` of `shape`.

    Args:
        shape: the mesh shape, e.g. `(2,)` or `(1, 4)`.
        axis_names: the mesh axis names; default the first `len(shape)`
            of `AXIS_NAMES`.
        devices: Keras device names; default `list_devices()`.
    """
    from keras import distribution as kd

    if axis_names is None:
        axis_names = AXIS_NAMES[: len(shape)]
    devices = kd.list_devices() if devices is None else devices
    return kd.DeviceMesh(shape, list(axis_names), devices)


def data_parallel(*, devices=None, auto_shard_dataset=True):
    """Returns a `DataParallel` on a 1D "batch" mesh (does not set it).

    Args:
        devices: Keras device names; default `list_devices()`.
        auto_shard_dataset: passed to `DataParallel`.
    """
    from keras import distribution as kd

    devices = kd.list_devices() if devices is None else devices
    mesh = device_mesh((len(devices),), devices=devices)
    return kd.DataParallel(
        device_mesh=mesh, auto_shard_dataset=auto_shard_dataset
    )


def use_data_parallel(*, devices=None, auto_shard_dataset=True):
    """Sets `data_parallel(...)` as the distribution; returns it."""
    return _use(
        data_parallel(devices=devices, auto_shard_dataset=auto_shard_dataset)
    )


def model_parallel(
    *,
    layout_rules,
    mesh_shape,
    axis_names=AXIS_NAMES,
    devices=None,
    auto_shard_dataset=True,
):
    """Returns a `ModelParallel` (does not set it).

    Args:
        layout_rules: dict of `LayoutMap` key -> axes tuple (may be empty).
        mesh_shape: shape of the device mesh.
        axis_names: the mesh axis names; the first one is the batch axis.
        devices: Keras device names; default `list_devices()`.
        auto_shard_dataset: passed to `ModelParallel`.

    The mesh is the distribution's `device_mesh`.
    """
    from keras import distribution as kd

    mesh = device_mesh(mesh_shape, axis_names=axis_names, devices=devices)
    layout_map = kd.LayoutMap(mesh)
    for key, axes in layout_rules.items():
        layout_map[key] = axes
    return kd.ModelParallel(
        layout_map=layout_map,
        batch_dim_name=axis_names[0],
        auto_shard_dataset=auto_shard_dataset,
    )


def use_model_parallel(
    *,
    layout_rules,
    mesh_shape,
    axis_names=AXIS_NAMES,
    devices=None,
    auto_shard_dataset=True,
):
    """Sets `model_parallel(...)` as the distribution; returns it."""
    return _use(
        model_parallel(
            layout_rules=layout_rules,
            mesh_shape=mesh_shape,
            axis_names=axis_names,
            devices=devices,
            auto_shard_dataset=auto_shard_dataset,
        )
    )


def setting_mesh_shape(setting, *, num_devices):
    """The ("batch", "model") mesh shape of a model-parallel setting."""
    return {"mp": (1, num_devices), "2x2": (2, 2)}[setting]


def use_setting(setting, *, layout_rules=None, auto_shard_dataset=True):
    """Sets the distribution of the named `setting`; returns it.

    Args:
        setting: one of `SETTINGS` (see the module docstring).
        layout_rules: the layout rules of the model-parallel settings
            ("mp", "2x2"); unused by the others.
        auto_shard_dataset: passed to the distribution.

    Returns:
        The distribution, None for "single" (which clears it).
    """
    from keras import distribution as kd

    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; one of {SETTINGS}")
    if setting == "single":
        kd.set_distribution(None)
        return None
    if setting == "dp":
        return use_data_parallel(auto_shard_dataset=auto_shard_dataset)
    if layout_rules is None:
        raise ValueError(f"setting {setting!r} needs layout_rules")
    num_devices = len(kd.list_devices())
    return use_model_parallel(
        layout_rules=layout_rules,
        mesh_shape=setting_mesh_shape(setting, num_devices=num_devices),
        auto_shard_dataset=auto_shard_dataset,
    )


def run_without_distribution(function, *args):
    """Runs `function(*args)` in this process with no distribution, in a
    fresh Keras session; returns its result."""
    import keras

    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    try:
        return function(*args)
    finally:
        keras.backend.clear_session()


def call_verdict(model, kind, training=False):
    """The probe's verdict (`batch_coupling.Verdict`) on `model`'s calls with
    `training` in its step function `kind`, or `None`."""
    from keras.src.backend.torch.distributed.training.step import model_step

    step = model_step(model, kind)
    rows = None if step is None else step.rows
    return None if rows is None else rows.verdicts.get(bool(training))


def _use(distribution):
    from keras import distribution as kd

    kd.set_distribution(distribution)
    return distribution
