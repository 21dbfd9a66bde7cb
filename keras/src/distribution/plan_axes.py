"""Mesh axes for a variable's dimensions, as `auto_plan` places them."""


class MeshAxes:
    """Places the model axis on the first dimension of a preferred order it
    divides, the batch axis (of `batch_size`, 1 where kernels are not sharded
    over it) on the largest free one."""

    def __init__(self, model_dim_name, model_size, batch_dim_name, batch_size):
        self.model_dim_name = model_dim_name
        self.model_size = model_size
        self.batch_dim_name = batch_dim_name
        self.batch_size = batch_size

    def shard(self, shape, order=(), describe=None):
        """`(axes, reason)` for `shape`: the model axis on the first dimension
        it divides, in `order` then the rest (none if no `order`); the batch
        axis as `with_batch`; `describe(dimension)` says why, in `reason`."""
        axes = [None] * len(shape)
        reasons = []
        if self.model_size > 1 and order:
            rest = [d for d in range(len(shape)) if d not in order]
            dim = next(
                (d for d in [*order, *rest] if shape[d] % self.model_size == 0),
                None,
            )
            if dim is None:
                reasons.append("replicated over model: no dimension divides")
            else:
                axes[dim] = self.model_dim_name
                reasons.append(describe(dim))
                if dim != order[0]:
                    reasons.append(
                        f"dimension {order[0]} indivisible by {self.model_size}"
                    )
        axes, reason = self.with_batch(shape, tuple(axes), "; ".join(reasons))
        if not reason:
            reason = describe(order[0]) if order else "replicated"
        return axes, reason

    def with_batch(self, shape, axes, reason):
        """`axes` with the batch axis on the largest dimension it divides
        that the model axis leaves whole (FSDP-like): a block's vector joins
        the block's gather and reduce-scatter, else stored whole everywhere.
        `axes` as given if the batch axis has size 1 or is the model's."""
        if self.batch_size == 1 or self.batch_dim_name in axes:
            return axes, reason
        batched = on_free_dimension(
            shape, axes, self.batch_dim_name, self.batch_size
        )
        if batched is None:
            return axes, reason
        batch = f"dimension {batched.index(self.batch_dim_name)} over batch"
        return batched, f"{reason}; {batch}" if reason else batch


def on_free_dimension(shape, axes, axis_name, axis_size):
    """`axes` with `axis_name` on the largest dimension of `shape` that no
    axis shards and `axis_size` divides, or `None` if none."""
    free = [
        d for d, a in enumerate(axes) if a is None and shape[d] % axis_size == 0
    ]
    if not free:
        return None
    dim = max(free, key=lambda d: shape[d])
    return tuple(axis_name if d == dim else a for d, a in enumerate(axes))
