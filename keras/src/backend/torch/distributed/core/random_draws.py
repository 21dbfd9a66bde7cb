"""Random draws by position, so each process draws only its part of one value
(as JAX partitions): under a distribution, element `p` of a draw takes one
32-bit word of counter `p >> 1`'s SplitMix64 output, the mix of
`key + (p >> 1) * _GAMMA + _GAMMA` (`uniform` and `normal` 24 of its bits,
`dropout` all 32); a float64 draw and `randint` take 53 bits of counter
`p`'s."""

import contextlib
import dataclasses
import math
import sys
import threading

import numpy as np
import torch

from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.torch.distributed.core import generator_states
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate

# SplitMix64's constants as signed int64 (torch's int64 wraps modulo 2**64).
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)
# SplitMix64's output function: `z ^= z >> shift` (logical), then `z *=
# factor` but in the last round.
_ROUNDS = ((30, _MIX_1), (27, _MIX_2), (31, None))
_MASK = (1 << 64) - 1
# The bit offsets of a counter's two 24-bit halves (`draw_halves`).
_HALVES = (8, 40)
_HALF_MASK = (1 << 24) - 1
# `SeedGenerator.next`'s step of a state, by dtype and device (`seed_key`).
_INCREMENTS = {}
# Below this many elements a torch op on the CPU runs on one thread (ATen's
# parallel grain): counters of a range fewer than this are mixed in NumPy.
_ONE_THREAD_ELEMENTS = 32768
# `mix`'s constants as NumPy uint64 (`_numpy_bits`): `(shift, factor)`s.
_NUMPY_GAMMA = np.uint64(_GAMMA & _MASK)
_NUMPY_ROUNDS = tuple(
    (np.uint64(bits), None if factor is None else np.uint64(factor & _MASK))
    for bits, factor in _ROUNDS
)


class _State(threading.local):
    # This thread's draw settings; the class attributes are the defaults.
    initializing = 0  # The depth of `initializing` blocks.
    rows = None  # `local_rows_scope`'s `(start, local_rows, global_rows, plan)`
    keys = None  # `one_key_per_call`'s `[key, keys derived from it]`


_state = _State()


@dataclasses.dataclass
class DrawPlan:
    """How a call on local rows draws: per probe draw, `("rows", shape[1:])`
    or `("whole", shape)`. `broken`: a later draw fit none; `unseeded`: keys
    from torch's generator; `python_draws`: the probe used Python's/NumPy's."""

    draws: list = dataclasses.field(default_factory=list)
    recording: bool = True
    broken: bool = False
    unseeded: int = 0
    python_draws: bool = False

    def decide(self, shape, local_rows):
        """Whether a draw of `shape` is the local rows of a global draw; a
        later call's must match exactly one of the probe's, or breaks it."""
        is_rows = len(shape) > 0 and shape[0] == local_rows
        draw = ("rows", shape[1:]) if is_rows else ("whole", shape)
        if self.recording:
            self.draws.append(draw)
            return is_rows
        whole = ("whole", shape) in self.draws
        rows = is_rows and draw in self.draws
        self.broken |= whole == rows
        return rows

    def following(self):
        """A copy of the plan that later calls follow."""
        return DrawPlan(
            list(self.draws), recording=False, python_draws=self.python_draws
        )


def by_position():
    """Whether draws go by position (a distribution or local rows), except in
    initializers and symbolic (meta device) calls."""
    if _state.initializing or (
        runtime.current_distribution() is None and _state.rows is None
    ):
        return False
    return runtime.backend_core().get_device() != "meta"


def initializing():
    """Draws in the block use torch's generators (variable initializers)."""
    return _setting("initializing", _state.initializing + 1)


def local_rows_scope(start, local_rows, global_rows, plan):
    """Draws in the block are rows `[start, start + local_rows)` of a batch
    of `global_rows`, as `plan` (a `DrawPlan`) decides per draw."""
    return _setting("rows", (start, local_rows, global_rows, plan))


def outside_rows():
    """Draws in the block are not local rows' (a layer run via DTensor)."""
    return _setting("rows", None)


@contextlib.contextmanager
def _setting(name, value):
    """Sets this thread's `_state.<name>` to `value` in the block."""
    previous = getattr(_state, name)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, previous)


def mix(z):
    """SplitMix64's output function of int64 values, in place on `z`."""
    shifted = torch.empty_like(z)
    for bits, factor in _ROUNDS:
        # A logical shift: torch's `>>` of int64 extends the sign.
        torch.bitwise_right_shift(z, bits, out=shifted)
        z.bitwise_xor_(shifted.bitwise_and_((1 << (64 - bits)) - 1))
        if factor is not None:
            z.mul_(factor)
    return z


def mix_int(z):
    """`mix` of one int64 value as Python integers (a key: no tensor ops)."""
    z &= _MASK
    for bits, factor in _ROUNDS:
        z ^= z >> bits
        if factor is not None:
            z = (z * factor) & _MASK
    return z - (1 << 64) if z >> 63 else z


def random_bits(key, index):
    """64 random bits (int64) per flat position of `index` (overwritten):
    the mix of `key + (index + 1) * _GAMMA`."""
    if isinstance(key, torch.Tensor):
        first = key + _GAMMA  # A 0-d int64 op: wraps as the elements do.
    else:
        first = ((key + _GAMMA + (1 << 63)) & _MASK) - (1 << 63)
    return mix(index.mul_(_GAMMA).add_(first))


def positions(global_shape, offsets, local_shape, device):
    """Flat positions in `global_shape` of a `local_shape` box at `offsets`."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    strides = layouts.contiguous_strides(global_shape)
    for dim, (start, size) in enumerate(zip(offsets, local_shape)):
        view = [size if d == dim else 1 for d in range(len(local_shape))]
        axis = torch.arange(start, start + size, device=device)
        index = index + axis.mul_(strides[dim]).view(view)
    return index.expand(tuple(local_shape)).contiguous()


def _span(box):
    """`(first position, count)` of `box` if its positions are one range (it
    is whole but for its first dimension), else `None`."""
    global_shape, offsets, local_shape = box
    if tuple(global_shape[1:]) != tuple(local_shape[1:]) or any(offsets[1:]):
        return None
    start = offsets[0] * math.prod(global_shape[1:]) if offsets else 0
    return start, math.prod(local_shape)


def range_bits(key, first, count, device):
    """`random_bits` of the counters `[first, first + count)`: mixed in NumPy
    where torch would run on one thread (a CPU key of Python integers, fewer
    counters than ATen's grain or one thread), whose uint64 shifts are
    logical and whose ops cost less each; else by torch's ops."""
    if (
        isinstance(key, int)
        and torch.device(device).type == "cpu"
        and (count < _ONE_THREAD_ELEMENTS or torch.get_num_threads() == 1)
        and not torch.compiler.is_compiling()
    ):
        return torch.from_numpy(_numpy_bits(key, first, count))
    index = torch.arange(first, first + count, device=device)
    return random_bits(key, index)


def _numpy_bits(key, first, count):
    """`random_bits` of the counters `[first, first + count)` as NumPy int64:
    SplitMix64 in uint64, which wraps and shifts as its definition does."""
    z = np.arange(first + 1, first + count + 1, dtype=np.uint64)
    z *= _NUMPY_GAMMA
    z += np.uint64(key & _MASK)
    shifted = np.empty_like(z)
    for bits, factor in _NUMPY_ROUNDS:
        np.right_shift(z, bits, out=shifted)
        z ^= shifted
        if factor is not None:
            z *= factor
    return z.view(np.int64)


def _counter_bits(key, box, device, ranges=True):
    """`(span, parity, bits)`: `random_bits` of the counters of `box`'s
    positions, one per pair where the box is one range (`span` of `_span`,
    if `ranges`), else one per position (`parity`: the positions' `p & 1`)."""
    span = _span(box) if ranges else None
    if span is None:
        index = positions(*box, device)
        parity = index & 1
        return span, parity, random_bits(key, index.bitwise_right_shift_(1))
    start, count = span
    first, end = start >> 1, (start + count + 1) >> 1
    return span, None, range_bits(key, first, end - first, device)


def draw_words(key, box, device):
    """Signed 32-bit words of `box` (`(global_shape, offsets, local_shape)`) by
    position: element `p` takes the low word of counter `p >> 1`'s
    `random_bits` if `p` is even, the high word if odd."""
    # A range's words are read as int32 pairs only in little-endian order.
    little = sys.byteorder == "little"
    span, parity, bits = _counter_bits(key, box, device, ranges=little)
    if span is None:
        # Sign-extended as int64: the low word from bits shifted up first.
        shifts = parity.bitwise_xor_(1).mul_(32)
        return bits.bitwise_left_shift_(shifts).bitwise_right_shift_(32)
    start, count = span
    # Little-endian int64 as int32 words: each counter's low word, then its
    # high word, so the even position's, then the odd one's.
    words = bits.view(torch.int32)[start & 1 : (start & 1) + count]
    return words.view(tuple(box[2]))


def draw_halves(key, box, device):
    """24-bit integers of `box` by position: bits 8-31 of `draw_words`."""
    words = draw_words(key, box, device)
    return words.bitwise_right_shift_(_HALVES[0]).bitwise_and_(_HALF_MASK)


def draw_pairs(key, box, device, pair):
    """Values of `box` by position as `draw_halves` takes its integers, the
    two halves of a counter made two values by `pair(low, high)`."""
    span, parity, bits = _counter_bits(key, box, device)
    low = torch.bitwise_right_shift(bits, _HALVES[0]).bitwise_and_(_HALF_MASK)
    high = bits.bitwise_right_shift_(_HALVES[1]).bitwise_and_(_HALF_MASK)
    even, odd = pair(low, high)
    if span is None:
        return torch.where(parity.bool(), odd, even)
    start, count = span
    both = torch.stack((even, odd), dim=-1).view(-1)
    return both[start & 1 : (start & 1) + count].view(tuple(box[2]))


def unit_uniform(key, box, device, dtype):
    """Uniforms in [0, 1) by position: 53 bits for float64, else 24 bits."""
    if dtype == torch.float64:
        span = _span(box)
        if span is None:
            bits = random_bits(key, positions(*box, device))
        else:
            bits = range_bits(key, *span, device).view(tuple(box[2]))
        bits = bits.bitwise_right_shift_(11)
        return bits.bitwise_and_((1 << 53) - 1).to(torch.float64) * 2.0**-53
    return draw_halves(key, box, device).float().mul_(2.0**-24)


def keep_mask(key, box, device, keep):
    """Booleans by position, each true with probability `keep` (in (0, 1)):
    `draw_words`' word plus 2**31 (uniform in [0, 2**32)) below
    `keep * 2**32`, compared on the signed word itself."""
    limit = math.ceil(float(keep) * 2**32) - 2**31 - 1
    return draw_words(key, box, device) <= limit


def standard_normal(key, box, device, dtype):
    """Standard normals by position (Box-Muller on each counter's pair)."""

    def pair(low, high):
        work = torch.float64 if dtype == torch.float64 else torch.float32
        radius = (low.to(work) + 1).mul_(2.0**-24).log_().mul_(-2.0).sqrt_()
        angle = high.to(work).mul_(2.0**-24 * 2 * torch.pi)
        return radius * angle.cos(), radius.mul_(angle.sin_())

    return draw_pairs(key, box, device, pair)


def seed_key(seed):
    """The int64 key of Keras' `seed` (advancing a seed generator)."""
    from keras.src.random.seed_generator import SeedGenerator
    from keras.src.random.seed_generator import draw_seed

    upstream_next = getattr(type(seed), "next", None) is SeedGenerator.next
    state = seed.state if upstream_next else None
    scope, value = get_stateless_scope(), None
    if state is not None and scope is not None:
        # The local rows' plain state (an integer: `.value` casts none).
        value = scope.get_current_value(state)
    if state is not None and value is None:
        value = state.value
    if state is None or isinstance(value, DTensor):
        value = draw_seed(seed)
        return _key(value.to_local() if isinstance(value, DTensor) else value)
    # `SeedGenerator.next` on plain state (the local rows, or a generator
    # made outside the distribution): the same step, without the NumPy
    # increment `next` converts each call. The key is read before the state
    # changes; the new state, of the state's dtype and shape, is the scope's
    # update as `assign` would add it.
    key = _key(value)
    value = value + _increment(value.dtype, value.device)
    if scope is None:
        state.assign(value)
    else:
        scope.add_update((state, value))
    return key


def _increment(dtype, device):
    """The tensor `[0, 1]` of `dtype` on `device`, made once (but in a graph
    being compiled, whose tensors are its own)."""
    if torch.compiler.is_compiling():
        return torch.tensor([0, 1], dtype=dtype, device=device)
    increment = _INCREMENTS.get((dtype, device))
    if increment is None:
        increment = torch.tensor([0, 1], dtype=dtype, device=device)
        _INCREMENTS[(dtype, device)] = increment
    return increment


def _key(seed):
    """The int64 key of a seed's two values (a tensor of `draw_seed`)."""
    if seed.device.type == "cpu" and not torch.compiler.is_compiling():
        # As Python integers, where a dozen ops on 0-d tensors would each
        # pay torch's dispatch (on a device, reading the seed would wait).
        first, second = seed.tolist()
        return mix_int(first * _GAMMA + second)
    seed = seed.long()
    return mix(seed[0] * _GAMMA + seed[1])


@contextlib.contextmanager
def one_key_per_call(started=None):
    """Unseeded draws in the block derive from one key of torch's generator,
    so a repeat of the probe's call draws the same keys with one collective;
    `started` (of `start_key`): that key, agreed in the background until the
    first draw needs it, and waited for at the end if none did."""
    if _state.keys is not None:
        yield
        return
    keys = [None, 0, started]
    with _setting("keys", keys):
        try:
            yield
        finally:
            if keys[2] is not None:
                _agreed(keys)


def start_key():
    """Draws a call's key from torch's generator and starts agreeing on
    process 0's: `(key, broadcast work or None)`, for `one_key_per_call`."""
    key = generator_states.torch_key()
    if runtime.world_size() == 1:
        return key, None
    key = key.to(runtime.comm_device())
    return key, torch.distributed.broadcast(key, src=0, async_op=True)


def _agreed(keys):
    """Sets `keys[0]` to the key `start_key` started agreeing on."""
    (key, work), keys[2] = keys[2], None
    if work is not None:
        work.wait()
    keys[0] = int(key)


def unseeded_key():
    """The key of an unseeded draw, from process 0's torch generator
    (processes may seed theirs differently), once per `one_key_per_call`."""
    keys = _state.keys
    if keys is not None and keys[0] is None and keys[2] is not None:
        _agreed(keys)
        return mix_int(keys[0])
    if keys is not None and keys[0] is not None:
        keys[1] += 1
        return mix_int(keys[0] + keys[1] * _GAMMA)
    if _state.rows is not None:
        _state.rows[3].unseeded += 1
    key = generator_states.torch_key()
    if runtime.world_size() > 1:
        key = key.to(runtime.comm_device())
        torch.distributed.broadcast(key, src=0)
    key = int(key)
    if keys is not None:
        keys[0] = key
    return mix_int(key)


def _draw_box(shape):
    """`(global_shape, offsets, local_shape)` of a draw of `shape` here."""
    shape, rows = tuple(int(d) for d in shape), _state.rows
    if rows is None or not rows[3].decide(shape, rows[1]):
        return shape, (0,) * len(shape), shape
    start, _, global_rows, _ = rows
    return (global_rows, *shape[1:]), (start,) + (0,) * (len(shape) - 1), shape


def uniform(shape, minval, maxval, dtype, seed):
    """`keras.random.uniform`, drawn by position."""
    values = unit_uniform(draw_key(seed), _draw_box(shape), _device(), dtype)
    return (values * (maxval - minval) + minval).to(dtype)


def normal(shape, mean, stddev, dtype, seed):
    """`keras.random.normal`, drawn by position (Box-Muller)."""
    values = standard_normal(draw_key(seed), _draw_box(shape), _device(), dtype)
    return (values * stddev + mean).to(dtype)


def randint(shape, minval, maxval, dtype, seed):
    """`keras.random.randint`, drawn by position."""
    box = _draw_box(shape)
    values = unit_uniform(draw_key(seed), box, _device(), torch.float64)
    return (values * (maxval - minval)).floor_().add_(minval).to(dtype)


def dropout(inputs, rate, noise_shape, seed):
    """`keras.random.dropout`, its mask drawn by position (a `DTensor`'s for
    its local part), keyed by `draw_key`."""
    is_dtensor = isinstance(inputs, DTensor)
    device = (inputs.to_local() if is_dtensor else inputs).device
    key = draw_key(seed)
    shape = tuple(inputs.shape)
    if noise_shape is not None:
        shape = tuple(
            d if n is None else int(n) for d, n in zip(shape, noise_shape)
        )
    if is_dtensor:
        mesh, placements = inputs.device_mesh, inputs.placements
        region = layouts.local_region(inputs.shape, mesh, placements)
        # A broadcast dimension of the mask (noise shape 1) is whole here.
        cut = [slice(0, 1) if n == 1 else r for r, n in zip(region, shape)]
        box = shape, [c.start for c in cut], [c.stop - c.start for c in cut]
    else:
        box = _draw_box(shape)
    keep = 1.0 - rate
    mask = keep_mask(key, box, device, keep)
    if is_dtensor:
        placements = [
            Replicate() if p.is_shard() and shape[p.dim] == 1 else p
            for p in layouts.reduced_placements(placements)
        ]
        mask = layouts.dtensor_from_local(mask, mesh, placements, shape=shape)
    return masked_product(inputs, mask, keep, device)


def masked_product(inputs, mask, keep, device):
    """`inputs * mask / keep` (a kept value `inputs * (1 / keep)`), saving for
    backward what torch's dropout saves on `device`: the booleans where it
    fuses dropout, else the scale (on the CPU: one op in backward)."""
    if device.type == "cpu":
        return inputs * mask.to(inputs.dtype).mul_(1 / keep)
    return inputs * mask * (1 / keep)


def draw_key(seed):
    """The key of a draw of `seed`: process 0's torch key where
    `torch_keyed(seed)`, else `seed_key(seed)`."""
    return unseeded_key() if torch_keyed(seed) else seed_key(seed)


def torch_keyed(seed):
    """Whether a draw of `seed` keys from process 0's torch generator: none
    given, in a layer call (one key a call, `one_key_per_call`; outside one,
    Keras' global seed generator, a variable outside any model, keys it), or
    an unseeded `SeedGenerator` whose state each process made on its own. One
    made under a distribution holds process 0's state
    (`variables.distribute_variable`) and keys from it, as JAX's unseeded
    layers do: without a collective."""
    from keras.src.random.seed_generator import SeedGenerator

    if seed is None:
        return _state.keys is not None
    return (
        isinstance(seed, SeedGenerator)
        and seed._initial_seed is None
        and not isinstance(seed.state._value, DTensor)
    )


def _device():
    return torch.device(runtime.backend_core().get_device())
