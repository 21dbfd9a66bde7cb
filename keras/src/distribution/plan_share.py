"""What each process stores of a model, as `AutoModelParallel` plans it.

The planner (`auto_plan`) decides each variable's layout at its creation,
before the model's size is known. `PlanShare` keeps the running account
those decisions are judged by: the float elements planned so far, and how
many of them each process stores beyond an even share (`1 / processes` of
each variable). A decision that would bring that excess past a fraction of
the model so far is not taken; since each variable is judged as it comes,
every prefix of the model, and so the whole, keeps within the fraction,
but for what the plan cannot shard instead (a variable no dimension of
which the model axis divides, or what precedes the first sharded one).
"""

import math


class PlanShare:
    """The running account of what each process stores beyond an even
    share.

    Args:
        model_dim_name: the mesh axis tensor parallelism shards over.
        model_size: its length.
        batch_dim_name: the mesh axis the batch is split over.
        batch_size: its length, 1 where kernels are not sharded over it.
    """

    def __init__(self, model_dim_name, model_size, batch_dim_name, batch_size):
        self.model_dim_name = model_dim_name
        self.model_size = model_size
        self.batch_dim_name = batch_dim_name
        self.batch_size = batch_size
        self.elements = 0
        self.excess = 0.0
        # Whether a variable has been sharded over the model axis yet.
        self.sharded = False

    def record(self, shape, axes):
        """Counts a float variable of `shape` laid out over `axes`."""
        size = math.prod(shape)
        self.elements += size
        self.excess += self.excess_of(size, axes)
        self.sharded = self.sharded or self.model_dim_name in axes

    def within(self, shape, axes, fraction):
        """Whether a variable of `shape` laid out over `axes` keeps the
        excess within `fraction` of the model so far, itself included."""
        size = math.prod(shape)
        excess = self.excess + self.excess_of(size, axes)
        return excess <= fraction * (self.elements + size)

    def excess_of(self, size, axes):
        """Elements of a variable of `size` laid out over `axes` that each
        process stores beyond an even share."""
        split = 1
        if self.model_dim_name in axes:
            split *= self.model_size
        if self.batch_dim_name in axes and self.batch_size > 1:
            split *= self.batch_size
        return size / split - size / (self.model_size * self.batch_size)

    def over_model(self, shape, axes):
        """`axes` with the model axis on the largest free dimension it
        divides, or `None` if none does (or the variable has it already)."""
        if self.model_size == 1 or self.model_dim_name in axes:
            return None
        return on_free_dimension(
            shape, axes, self.model_dim_name, self.model_size
        )


def on_free_dimension(shape, axes, axis_name, axis_size):
    """`axes` with `axis_name` on the largest dimension of `shape` that no
    axis shards and `axis_size` divides, or `None` if none.

    Args:
        shape: the variable's shape.
        axes: the mesh axis of each dimension (or `None`).
        axis_name: the mesh axis to add.
        axis_size: its length.

    Returns:
        A tuple of mesh axis names (or `None`), or `None`.
    """
    free = sorted(
        (d for d, a in enumerate(axes) if a is None), key=lambda d: -shape[d]
    )
    for d in free:
        if shape[d] % axis_size == 0:
            placed = list(axes)
            placed[d] = axis_name
            return tuple(placed)
    return None
