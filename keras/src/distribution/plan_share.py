"""What each process stores of a model, as `auto_plan` plans it.

Variables are laid out before the model's size is known, so `PlanShare` bounds
each process' excess over an even share for every prefix of the model, which
bounds the whole model except what cannot be sharded (no dimension divisible by
the model axis, or before the first sharded variable).
"""

import math

from keras.src.distribution import plan_axes


class PlanShare:
    """The running account of what each process stores beyond an even share."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.elements = 0
        self.excess = 0.0
        # Whether any variable is model-sharded yet.
        self.sharded = False

    def record(self, shape, axes):
        """Counts a float variable of `shape` laid out over `axes`."""
        size = math.prod(shape)
        self.elements += size
        self.excess += self.excess_of(size, axes)
        self.sharded = self.sharded or self.mesh.model_dim_name in axes

    def within(self, shape, axes, fraction):
        """Whether adding a variable keeps the excess within `fraction`."""
        size = math.prod(shape)
        excess = self.excess + self.excess_of(size, axes)
        return excess <= fraction * (self.elements + size)

    def bounded(self, shape, axes, reason, fraction, gathered):
        """`(axes, reason, bound)`: over the model axis (`bound`) where `axes`
        exceed `fraction`, once a variable is model-sharded (an input norm
        before the first kernel, the whole model so far, always exceeds)."""
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
        """Whether `new` axes (not `old`) fit `fraction`; if so, counts them."""
        size = math.prod(shape)
        excess = self.excess + self.excess_of(size, new)
        excess -= self.excess_of(size, old)
        if excess > fraction * self.elements:
            return False
        self.excess = excess
        return True

    def excess_of(self, size, axes):
        """Elements each process stores beyond an even share of a variable."""
        split = 1
        if self.mesh.model_dim_name in axes:
            split *= self.mesh.model_size
        if self.mesh.batch_dim_name in axes and self.mesh.batch_size > 1:
            split *= self.mesh.batch_size
        even = size / (self.mesh.model_size * self.mesh.batch_size)
        return size / split - even

    def over_model(self, shape, axes):
        """`axes` + model axis on the largest free dim it divides, or `None`."""
        if self.mesh.model_size == 1 or self.mesh.model_dim_name in axes:
            return None
        return plan_axes.on_free_dimension(
            shape, axes, self.mesh.model_dim_name, self.mesh.model_size
        )
