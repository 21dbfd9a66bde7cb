"""`AutoModelParallel`: model parallelism with no `LayoutMap` to write; the
variables no rule matches are laid out at creation by `auto_plan`."""

import re

from keras.src.api_export import keras_export
from keras.src.distribution import auto_plan
from keras.src.distribution.distribution_lib import DeviceMesh
from keras.src.distribution.distribution_lib import LayoutMap
from keras.src.distribution.distribution_lib import ModelParallel
from keras.src.distribution.distribution_lib import TensorLayout
from keras.src.distribution.distribution_lib import list_devices


@keras_export("keras.distribution.AutoModelParallel")
class AutoModelParallel(ModelParallel):
    """Tensor parallelism planned from the model itself.

    Shards every model Megatron-style over the mesh's model axis (and, if
    the batch axis is longer than one, each kernel's largest other dimension
    over it), with no `LayoutMap` to write. Set it before creating the model:

    ```python
    keras.distribution.set_distribution(keras.distribution.AutoModelParallel())
    model = keras_hub.models.CausalLM.from_preset(...)
    keras.distribution.sharding_summary(model, print_fn=print)
    ```

    Args:
        device_mesh: a `DeviceMesh`. Defaults to `layout_map`'s mesh, else
            all devices on a `("batch", "model")` mesh of shape `(1, N)`.
        batch_dim_name: the mesh axis the batch is split over. Defaults to
            `"batch"` if the mesh has it, else its first axis.
        model_dim_name: the mesh axis tensor parallelism shards over.
            Defaults to `"model"` if the mesh has it, else its last axis.
        layout_map: optional `LayoutMap` on the same mesh whose rules
            override the plan (and lay out outputs, as in `ModelParallel`).
        auto_shard_dataset: as for `ModelParallel`.
    """

    def __init__(
        self,
        device_mesh=None,
        batch_dim_name=None,
        model_dim_name=None,
        layout_map=None,
        auto_shard_dataset=True,
    ):
        device_mesh, layout_map = _mesh_and_map(device_mesh, layout_map)
        names = list(device_mesh.axis_names)
        batch_dim_name = batch_dim_name or _axis(names, "batch", 0)
        model_dim_name = model_dim_name or _axis(names, "model", -1)
        if model_dim_name not in names:
            raise ValueError(
                f"`model_dim_name='{model_dim_name}'` is not an axis of the "
                f"device mesh, whose axes are {names}. Pass the name of "
                "the mesh axis to shard the model over."
            )
        if model_dim_name == batch_dim_name and len(names) > 1:
            raise ValueError(
                f"`model_dim_name` and `batch_dim_name` are both "
                f"'{model_dim_name}'. Pass two different axes of the mesh "
                f"{names}."
            )
        super().__init__(
            layout_map=layout_map,
            batch_dim_name=batch_dim_name,
            auto_shard_dataset=auto_shard_dataset,
        )
        self.model_dim_name = model_dim_name
        mesh_shape = dict(zip(names, device_mesh.shape))
        self._plan = auto_plan.Plan(mesh_shape, model_dim_name, batch_dim_name)
        self._reasons = {}

    def get_variable_layout(self, variable):
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        layout = self._layout_map[variable.path]
        if layout is not None:
            key = _rule_key(self._layout_map, variable.path)
            self._reasons[variable.path] = "rule: " + key
            return layout
        axes, reason = self._plan.layout_axes(variable)
        self._reasons[variable.path] = "auto: " + reason
        return TensorLayout(axes, self.device_mesh)

    def gathered_for_call(self, variable):
        """Whether `variable` is stored sharded but gathered for each call."""
        return self._plan.gathered_for_call(variable)

    def kernel_role(self, layer):
        """How the plan shards `layer`'s kernel: `"column"` (output features
        or heads), `"row"` (input's), `"stack"` (whole matrices), or `None`."""
        return self._plan.kernel_role(layer)

    def paired_role(self, layer):
        """The role widths alone gave `layer`'s kernel, until checked."""
        return self._plan.paired_role(layer)

    def check_pairing(self, layer, reads_column_output):
        """`[(variable, TensorLayout)]` laying `layer`'s kernel and bias out
        again, row parallel if `reads_column_output` (its first call reads a
        column-parallel output), else column, where widths paired it not so."""
        role = auto_plan.ROW if reads_column_output else auto_plan.COLUMN
        weights = [
            (v, v._layout.axes)
            for v in layer.weights
            if getattr(v, "_layout", None) is not None
            and not self._reasons.get(v.path, "").startswith("rule: ")
        ]
        relaid = self._plan.check_pairing(layer, role, weights)
        for variable, _, reason in relaid:
            self._reasons[variable.path] = "auto: " + reason
        return [
            (v, TensorLayout(axes, self.device_mesh)) for v, axes, _ in relaid
        ]

    def layout_reason(self, path):
        """What laid out the variable at `path`: `"rule: <key>"` for a
        `LayoutMap` rule, `"auto: <reason>"` for the plan, else `None`."""
        return self._reasons.get(path)


def _mesh_and_map(device_mesh, layout_map):
    """The mesh (checked against `layout_map`'s) and the layout map."""
    if layout_map is not None and not isinstance(layout_map, LayoutMap):
        raise ValueError(
            "Argument `layout_map` must be a `LayoutMap` instance or `None`. "
            f"Received: layout_map={layout_map}"
        )
    if device_mesh is None and layout_map is None:
        devices = list_devices()
        device_mesh = DeviceMesh((1, len(devices)), ("batch", "model"), devices)
    elif device_mesh is None:
        device_mesh = layout_map.device_mesh
    elif layout_map is not None and layout_map.device_mesh is not device_mesh:
        raise ValueError(
            "`layout_map` must be built on the `device_mesh` passed to "
            "`AutoModelParallel`. Received a layout map on a mesh of shape "
            f"{layout_map.device_mesh.shape} and a device mesh of shape "
            f"{device_mesh.shape}. Pass only one of them, or build the "
            "layout map with `LayoutMap(device_mesh)`."
        )
    if layout_map is None:
        layout_map = LayoutMap(device_mesh)
    return device_mesh, layout_map


def _axis(names, name, index):
    return name if name in names else names[index]


def _rule_key(layout_map, path):
    # Not `path in layout_map`: `LayoutMap` answers every lookup.
    keys = list(layout_map)
    matches = (key for key in keys if re.fullmatch(key, path))
    return path if path in keys else next(matches, path)
