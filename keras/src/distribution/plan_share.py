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

from keras.src.distribution import plan_axes


class PlanShare:
    """The running account of what each process stores beyond an even
    share.

    Args:
        mesh: the plan's `plan_axes.MeshAxes`.
    """

    def __init__(self, mesh):
        self.mesh = mesh
        self.elements = 0
        self.excess = 0.0
        # Whether a variable has been sharded over the model axis yet.
        self.sharded = False

    def record(self, shape, axes):
        """Counts a float variable of `shape` laid out over `axes`."""
        size = math.prod(shape)
        self.elements += size
        self.excess += self.excess_of(size, axes)
        self.sharded = self.sharded or self.mesh.model_dim_name in axes

    def within(self, shape, axes, fraction):
        """Whether a variable of `shape` laid out over `axes` keeps the
        excess within `fraction` of the model so far, itself included."""
        size = math.prod(shape)
        excess = self.excess + self.excess_of(size, axes)
        return excess <= fraction * (self.elements + size)

    def bounded(self, shape, axes, reason, fraction, gathered):
        """`axes`, or a weight replicated over the model axis sharded over
        it where replicating it would bring the excess past `fraction`.

        Not judged before the first variable sharded over the model axis:
        what precedes a model's first kernel (an input norm) is all the
        model there is so far, and every such vector would pass the bound.

        Args:
            shape: the variable's shape.
            axes: its mesh axes as planned.
            reason: why they were planned so.
            fraction: the bound, a fraction of the model so far.
            gathered: whether a weight sharded so is gathered for each
                call of its layer (said in the reason).

        Returns:
            `(axes, reason, bound)`, `bound` saying whether the bound
            changed the axes.
        """
        if not self.sharded or self.within(shape, axes, fraction):
            return axes, reason, False
        sharded = self.over_model(shape, axes)
        if sharded is None:
            return axes, reason, False
        dim = sharded.index(self.mesh.model_dim_name)
        how = ", gathered for each call" if gathered else ""
        return (
            sharded,
            f"dimension {dim} over model{how}: replicated weights past "
            f"{fraction:.0%} of the model ({reason})",
            True,
        )

    def relaid(self, shape, old, new, fraction):
        """Counts a variable of `shape` laid out over `new` instead of
        `old`, if that keeps the excess within `fraction` of the model so
        far; returns whether it did."""
        size = math.prod(shape)
        excess = self.excess + self.excess_of(size, new)
        excess -= self.excess_of(size, old)
        if excess > fraction * self.elements:
            return False
        self.excess = excess
        return True

    def excess_of(self, size, axes):
        """Elements of a variable of `size` laid out over `axes` that each
        process stores beyond an even share."""
        split = 1
        if self.mesh.model_dim_name in axes:
            split *= self.mesh.model_size
        if self.mesh.batch_dim_name in axes and self.mesh.batch_size > 1:
            split *= self.mesh.batch_size
        return size / split - size / (
            self.mesh.model_size * self.mesh.batch_size
        )

    def over_model(self, shape, axes):
        """`axes` with the model axis on the largest free dimension it
        divides, or `None` if none does (or the variable has it already)."""
        if self.mesh.model_size == 1 or self.mesh.model_dim_name in axes:
            return None
        return plan_axes.on_free_dimension(
            shape, axes, self.mesh.model_dim_name, self.mesh.model_size
        )
