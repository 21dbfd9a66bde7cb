"""What each process stores of a model as `auto_plan` lays it out: its excess
over an even share, bounded for every prefix of the model (its size unknown)."""

import math

from keras.src.distribution import plan_axes


class PlanShare:
    """The running account of what each process stores beyond an even share;
    `sharded`: whether any variable is model-sharded yet."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.elements, self.excess, self.sharded = 0, 0.0, False

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
        mesh = self.mesh
        if (
            not self.sharded
            or mesh.model_dim_name in axes
            or self.within(shape, axes, fraction)
        ):
            return axes, reason, False
        sharded = plan_axes.on_free_dimension(
            shape, axes, mesh.model_dim_name, mesh.model_size
        )
        if sharded is None:
            return axes, reason, False
        dim = sharded.index(mesh.model_dim_name)
        how = ", gathered for each call" if gathered else ""
        reason = (
            f"dimension {dim} over model{how}: replicated weights "
            f"past {fraction:.0%} of the model ({reason})"
        )
        return sharded, reason, True

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
        mesh = self.mesh
        split = mesh.model_size if mesh.model_dim_name in axes else 1
        if mesh.batch_dim_name in axes and mesh.batch_size > 1:
            split *= mesh.batch_size
        return size / split - size / (mesh.model_size * mesh.batch_size)
