"""Random numbers drawn by position: each process draws only its part.

Under a distribution, the torch backend's `uniform`, `normal` (and so
`truncated_normal`), `randint` and `dropout` draw each element as a
counter-based function of a 64-bit key and of the element's position in
the global tensor: SplitMix64's output function of `key + (index + 1) *
0x9E3779B97F4A7C15`. torch's generators draw a tensor as one sequence,
which cannot be cut into parts; a function of the position can. So:

- a process computes the elements it holds and no others (a dropout mask
  on a batch-sharded `DTensor`, a draw on a process' own rows), in memory
  and time that follow its share;
- the values do not depend on the layout: one process under the same
  distribution, 2 or 4 processes, a 2-D mesh, the whole tensor or its
  rows all draw the same numbers for the same seed, as the JAX backend's
  partitionable draws do.

Each 64 random bits give two elements (24 bits each): an even position
and the odd one after it; Box-Muller turns such a pair of uniforms into
two normal numbers. float64 draws take 53 bits of one counter each.

The key comes from the seed as upstream's does: `draw_seed(seed)` (a seed
generator's state, advanced as usual), and for dropout without a seed from
torch's global generator (upstream's unseeded fast path), process 0's.
Initializers keep torch's generators: a variable's first value is the one
Keras computes without a distribution. `gamma`, `binomial`, `beta`,
`categorical` and `shuffle` keep upstream's draws too (the same on every
process, of the whole tensor).

In a call on a process' own rows (`local_rows`), a draw whose first
dimension is the number of local rows is taken as rows `[start, stop)` of
the draw of the global batch. The first call of a step function (its
probe) records, per draw, whether it was rows or whole, and checks the
call's outputs against DTensor's; later calls must draw alike
(`DrawPlan`), or the call runs through DTensor.
"""

import contextlib
import dataclasses
import threading

import torch

from keras.src.backend.torch.distributed.core import generator_states
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor

# SplitMix64's constants, as signed 64-bit integers (torch's int64
# arithmetic wraps like unsigned arithmetic modulo 2**64).
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)

_state = threading.local()


@dataclasses.dataclass
class DrawPlan:
    """How a call on local rows draws: per draw, rows or the whole shape.

    Attributes:
        draws: one entry per draw of the probe's call: `("rows",
            shape[1:])` or `("whole", shape)`.
        recording: whether the call being made records (the probe) or
            follows the plan.
        broken: whether a draw of a following call did not fit the plan
            (the call must then run through DTensor).
        unseeded: how many keys the call took from torch's generator.
        python_draws: whether the probe's call drew from Python's or
            NumPy's global generator (as its DTensor call did), which later
            calls may then do too.
    """

    draws: list = dataclasses.field(default_factory=list)
    recording: bool = True
    broken: bool = False
    unseeded: int = 0
    python_draws: bool = False

    def decide(self, shape, local_rows):
        """Whether a draw of `shape` is the local rows of a global draw.

        The probe's call takes a draw whose first dimension is the number
        of local rows for rows. A later call draws whole a shape the probe
        drew whole, and as rows one that differs from a probe's rows draw
        only in the local rows; a shape that fits neither, or both (a
        draw of the probe's whole shape that could be this process' rows),
        breaks the plan.
        """
        shape = tuple(shape)
        is_rows = len(shape) > 0 and shape[0] == local_rows
        if self.recording:
            self.draws.append(
                ("rows", shape[1:]) if is_rows else ("whole", shape)
            )
            return is_rows
        whole = ("whole", shape) in self.draws
        rows = is_rows and ("rows", shape[1:]) in self.draws
        if whole == rows:
            self.broken = True
        return rows

    def following(self):
        """A copy of the plan that later calls follow."""
        return DrawPlan(
            list(self.draws), recording=False, python_draws=self.python_draws
        )


def by_position():
    """Whether the torch backend's draws are drawn by position now.

    Under a distribution (also on one process) or in a call on local
    rows, except while a variable computes its first value and in symbolic
    calls (shapes only).
    """
    if (
        runtime.current_distribution() is None
        and getattr(_state, "rows", None) is None
    ):
        return False
    if getattr(_state, "initializing", 0):
        return False
    return runtime.backend_core().get_device() != "meta"


@contextlib.contextmanager
def initializing():
    """Draws in the block use torch's generators, as without a distribution:
    a variable's initializer."""
    _state.initializing = getattr(_state, "initializing", 0) + 1
    try:
        yield
    finally:
        _state.initializing -= 1


@contextlib.contextmanager
def local_rows_scope(start, local_rows, global_rows, plan):
    """Draws in the block are made on rows `[start, start + local_rows)` of
    a global batch of `global_rows`, as `plan` says.

    Args:
        start: the first global row this process holds.
        local_rows: how many rows it holds.
        global_rows: the rows of the global batch.
        plan: a `DrawPlan`, recording or to follow.
    """
    previous = getattr(_state, "rows", None)
    _state.rows = (start, local_rows, global_rows, plan)
    try:
        yield
    finally:
        _state.rows = previous


@contextlib.contextmanager
def outside_rows():
    """Draws in the block are not a call on local rows' own (a layer of
    that call called through DTensor draws on its DTensors)."""
    previous = getattr(_state, "rows", None)
    _state.rows = None
    try:
        yield
    finally:
        _state.rows = previous


def mix(z):
    """SplitMix64's output function of int64 values, elementwise.

    Computed in place on `z`, with one temporary.
    """
    shifted = torch.empty_like(z)
    for bits, factor in ((30, _MIX_1), (27, _MIX_2), (31, None)):
        # A logical shift: torch's `>>` of int64 extends the sign.
        torch.bitwise_right_shift(z, bits, out=shifted)
        z.bitwise_xor_(shifted.bitwise_and_((1 << (64 - bits)) - 1))
        if factor is not None:
            z.mul_(factor)
    return z


def random_bits(key, index):
    """64 random bits per element of `index` (flat positions), as int64.

    Args:
        key: an int64 tensor of one element (or a Python int).
        index: an int64 tensor of positions, overwritten.
    """
    return mix(index.add_(1).mul_(_GAMMA).add_(key))


def positions(global_shape, offsets, local_shape, device):
    """The flat positions in `global_shape` of a box of it.

    Args:
        global_shape: the shape of the whole draw.
        offsets: where the box starts on each dimension.
        local_shape: the box's shape.
        device: where to make the positions.

    Returns:
        An int64 tensor of `local_shape`.
    """
    ndim = len(global_shape)
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(ndim)):
        view = [1] * ndim
        view[dim] = local_shape[dim]
        start = offsets[dim]
        axis = torch.arange(
            start, start + local_shape[dim], dtype=torch.int64, device=device
        )
        index = index + axis.mul_(stride).view(view)
        stride *= global_shape[dim]
    return index.expand(tuple(local_shape)).contiguous()


def draw_pairs(key, box, device, pair):
    """Values by position, two elements from each 64 random bits.

    Element `p` (its flat position) takes the 64 bits at counter `p >> 1`:
    `pair(low, high)` turns the two 24-bit halves of each counter's bits
    into the values of its even and odd element.

    Args:
        key: the draw's key.
        box: `(global_shape, offsets, local_shape)`: what to draw of what.
        device: where.
        pair: `pair(low, high) -> (even, odd)`, elementwise.

    Returns:
        A tensor of the box's shape.
    """
    global_shape, offsets, local_shape = box
    count = _size(local_shape)
    if _is_row_range(global_shape, offsets, local_shape):
        start = offsets[0] * _size(global_shape[1:]) if offsets else 0
        first, last = start >> 1, (start + count + 1) >> 1
        bits = random_bits(
            key, torch.arange(first, last, dtype=torch.int64, device=device)
        )
        even, odd = pair(*_halves(bits))
        both = torch.stack((even, odd), dim=-1).view(-1)
        return both[start & 1 : (start & 1) + count].view(tuple(local_shape))
    index = positions(global_shape, offsets, local_shape, device)
    is_odd = (index & 1).bool()
    even, odd = pair(*_halves(random_bits(key, index.bitwise_right_shift_(1))))
    return torch.where(is_odd, odd, even)


def _halves(bits):
    low = torch.bitwise_right_shift(bits, 8).bitwise_and_(0xFFFFFF)
    high = bits.bitwise_right_shift_(40).bitwise_and_(0xFFFFFF)
    return low, high


def _size(shape):
    size = 1
    for d in shape:
        size *= d
    return size


def _is_row_range(global_shape, offsets, local_shape):
    # Whole but for its first dimension: one range of positions.
    return tuple(global_shape[1:]) == tuple(local_shape[1:]) and not any(
        offsets[1:]
    )


def unit_uniform(key, box, device, dtype):
    """Uniform numbers in [0, 1) by position, of `dtype` (float64: 53
    bits each; other types: 24 bits, computed in float32)."""
    if dtype == torch.float64:
        index = positions(*box, device)
        bits = random_bits(key, index).bitwise_right_shift_(11)
        return bits.bitwise_and_((1 << 53) - 1).to(torch.float64) * 2.0**-53
    return draw_pairs(key, box, device, _unit_pair)


def _unit_pair(low, high):
    return low.to(torch.float32) * 2.0**-24, high.to(torch.float32) * 2.0**-24


def keep_mask(key, box, device, keep):
    """Booleans by position, each true with probability `keep` (the
    uniform of `unit_uniform` below `keep`)."""
    threshold = keep * 2.0**24

    def pair(low, high):
        return low < threshold, high < threshold

    return draw_pairs(key, box, device, pair)


def standard_normal(key, box, device, dtype):
    """Standard normal numbers by position: Box-Muller on each counter's
    two uniforms gives its even and odd element."""

    def pair(low, high):
        work = torch.float64 if dtype == torch.float64 else torch.float32
        radius = (low.to(work) + 1).mul_(2.0**-24).log_().mul_(-2.0).sqrt_()
        angle = high.to(work).mul_(2.0**-24 * 2 * torch.pi)
        return radius * angle.cos(), radius.mul_(angle.sin_())

    return draw_pairs(key, box, device, pair)


def seed_key(seed):
    """The int64 key of a draw with Keras' `seed` (advancing a seed
    generator as upstream does), as a tensor on the seed's device."""
    from keras.src.random.seed_generator import draw_seed

    seed = draw_seed(seed)
    if isinstance(seed, DTensor):
        seed = seed.to_local()
    seed = seed.to(torch.int64)
    return mix(seed[0] * _GAMMA + seed[1])


@contextlib.contextmanager
def one_key_per_call():
    """Unseeded draws in the block share one key of torch's generator.

    The first takes a key from torch's global generator (process 0's, one
    collective); each later one takes the next of a sequence derived from
    it, with no collective. A model's call is the block: its draws are the
    same on every process, in the same order, and a call repeated from the
    same generator state (the probe's) draws the same keys. Nested blocks
    are one.
    """
    if getattr(_state, "keys", None) is not None:
        yield
        return
    _state.keys = [None, 0]
    try:
        yield
    finally:
        _state.keys = None


def unseeded_key():
    """The key of a draw without a seed, from torch's global generator.

    Process 0's: processes may have seeded their generators differently
    (a script's own per-process randomness), and every process must draw
    the same numbers. A collective of one number, on every process, once
    per `one_key_per_call` block.
    """
    keys = getattr(_state, "keys", None)
    if keys is not None and keys[0] is not None:
        keys[1] += 1
        return mix(keys[0] + _wrapped(keys[1] * _GAMMA))
    rows = getattr(_state, "rows", None)
    if rows is not None:
        rows[3].unseeded += 1
    key = generator_states.torch_key()
    if runtime.world_size() > 1:
        key = key.to(runtime.comm_device())
        torch.distributed.broadcast(key, src=0)
    if keys is not None:
        keys[0] = key
    return mix(key.clone())


def _wrapped(value):
    """A Python integer as the int64 it is modulo 2**64."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _draw_box(shape):
    """`(global_shape, offsets, local_shape)` of a draw of `shape` here."""
    shape = tuple(int(d) for d in shape)
    rows = getattr(_state, "rows", None)
    if rows is None:
        return shape, (0,) * len(shape), shape
    start, local_rows, global_rows, plan = rows
    if not plan.decide(shape, local_rows):
        return shape, (0,) * len(shape), shape
    offsets = (start,) + (0,) * (len(shape) - 1)
    return (global_rows,) + shape[1:], offsets, shape


def uniform(shape, minval, maxval, dtype, seed):
    """`keras.random.uniform`, drawn by position."""
    values = unit_uniform(seed_key(seed), _draw_box(shape), _device(), dtype)
    return (values * (maxval - minval) + minval).to(dtype)


def normal(shape, mean, stddev, dtype, seed):
    """`keras.random.normal`, drawn by position (Box-Muller)."""
    values = standard_normal(seed_key(seed), _draw_box(shape), _device(), dtype)
    return (values * stddev + mean).to(dtype)


def randint(shape, minval, maxval, dtype, seed):
    """`keras.random.randint`, drawn by position."""
    box = _draw_box(shape)
    values = unit_uniform(seed_key(seed), box, _device(), torch.float64)
    return (values * (maxval - minval)).floor_().add_(minval).to(dtype)


def dropout(inputs, rate, noise_shape, seed):
    """`keras.random.dropout`, its mask drawn by position.

    The mask of a `DTensor` is drawn on each process for the elements it
    holds and laid out as the inputs are.

    Args:
        inputs: a tensor or `DTensor`.
        rate: the probability of dropping an element.
        noise_shape: the mask's shape (`None` entries: the inputs'), or
            `None`.
        seed: the draw's seed (`None` or a seed generator without a seed:
            torch's global generator).
    """
    from keras.src.random.seed_generator import SeedGenerator

    unseeded = seed is None or (
        isinstance(seed, SeedGenerator) and seed._initial_seed is None
    )
    if unseeded:
        key = unseeded_key().to(_device_of(inputs))
    else:
        key = seed_key(seed)
    shape = tuple(inputs.shape)
    if noise_shape is not None:
        shape = tuple(
            d if n is None else int(n) for d, n in zip(shape, noise_shape)
        )
    keep = 1.0 - rate
    if isinstance(inputs, DTensor):
        scale = _dtensor_scale(inputs, shape, key, keep)
    else:
        mask = keep_mask(key, _draw_box(shape), inputs.device, keep)
        scale = _scale(mask, inputs.dtype, keep)
    # One product, as torch's own dropout: its gradient is one product too.
    return inputs * scale


def _scale(mask, dtype, keep):
    """`1 / keep` where `mask` keeps an element, 0 where it drops it."""
    return mask.to(dtype).mul_(1.0 / keep)


def _dtensor_scale(inputs, shape, key, keep):
    """The scale of `shape` for a `DTensor`'s local part, as a `DTensor`."""
    mesh, placements = inputs.device_mesh, tuple(inputs.placements)
    region = layouts.local_region(inputs.shape, mesh, placements)
    offsets = [r.start for r in region]
    local_shape = [r.stop - r.start for r in region]
    # A broadcast dimension of the mask (noise shape 1) is whole everywhere.
    offsets = [o if n != 1 else 0 for o, n in zip(offsets, shape)]
    local_shape = [s if n != 1 else 1 for s, n in zip(local_shape, shape)]
    device = inputs.to_local().device
    mask = keep_mask(key, (shape, offsets, local_shape), device, keep)
    mask = _scale(mask, inputs.dtype, keep)
    # A partial input's mask, and a mask dimension of 1, are whole.
    mask_placements = [
        _replicate()
        if p.is_partial() or (p.is_shard() and shape[p.dim] == 1)
        else p
        for p in placements
    ]
    return layouts.dtensor_from_local(mask, mesh, mask_placements, shape=shape)


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()


def _device():
    device = runtime.backend_core().get_device()
    return torch.device(device)


def _device_of(inputs):
    if isinstance(inputs, DTensor):
        return inputs.to_local().device
    return inputs.device
