"""Random draws under a distribution, by position (`counter_draws`), so each
process draws only its part of one value (as JAX partitions): the key of
each draw (its seed generator's, or process 0's torch generator's for an
unseeded one) and the box of the global draw that this process holds."""

import contextlib
import dataclasses
import threading

import torch

from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.torch.distributed.core import counter_draws
from keras.src.backend.torch.distributed.core import generator_states
from keras.src.backend.torch.distributed.core import layouts
from keras.src.backend.torch.distributed.core import runtime
from keras.src.backend.torch.distributed.core.runtime import DTensor
from keras.src.backend.torch.distributed.core.runtime import Replicate

# `SeedGenerator.next`'s step of a state, by dtype and device (`seed_key`).
_INCREMENTS = {}


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
        return counter_draws.pair_key(first, second)
    seed = seed.long()
    return counter_draws.pair_key(seed[0], seed[1])


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
        return counter_draws.mix_int(keys[0])
    if keys is not None and keys[0] is not None:
        keys[1] += 1
        return counter_draws.pair_key(keys[1], keys[0])
    if _state.rows is not None:
        _state.rows[3].unseeded += 1
    key = generator_states.torch_key()
    if runtime.world_size() > 1:
        key = key.to(runtime.comm_device())
        torch.distributed.broadcast(key, src=0)
    key = int(key)
    if keys is not None:
        keys[0] = key
    return counter_draws.mix_int(key)


def _draw_box(shape):
    """`(global_shape, offsets, local_shape)` of a draw of `shape` here."""
    shape, rows = tuple(int(d) for d in shape), _state.rows
    if rows is None or not rows[3].decide(shape, rows[1]):
        return shape, (0,) * len(shape), shape
    start, _, global_rows, _ = rows
    return (global_rows, *shape[1:]), (start,) + (0,) * (len(shape) - 1), shape


def uniform(shape, minval, maxval, dtype, seed):
    """`keras.random.uniform`, drawn by position."""
    values = counter_draws.unit_uniform(
        draw_key(seed), _draw_box(shape), _device(), dtype
    )
    return (values * (maxval - minval) + minval).to(dtype)


def normal(shape, mean, stddev, dtype, seed):
    """`keras.random.normal`, drawn by position (Box-Muller)."""
    values = counter_draws.standard_normal(
        draw_key(seed), _draw_box(shape), _device(), dtype
    )
    return (values * stddev + mean).to(dtype)


def randint(shape, minval, maxval, dtype, seed):
    """`keras.random.randint`, drawn by position."""
    box = _draw_box(shape)
    values = counter_draws.unit_uniform(
        draw_key(seed), box, _device(), torch.float64
    )
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
    if device.type == "cpu":
        factor = counter_draws.keep_scale(key, box, device, keep, inputs.dtype)
    else:
        factor = counter_draws.keep_mask(key, box, device, keep)
    if is_dtensor:
        placements = [
            Replicate() if p.is_shard() and shape[p.dim] == 1 else p
            for p in layouts.reduced_placements(placements)
        ]
        factor = layouts.dtensor_from_local(
            factor, mesh, placements, shape=shape
        )
    return counter_draws.masked_product(inputs, factor, keep)


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
