"""Random numbers drawn by position under a distribution.

`random_draws` draws each element from its position in the global tensor
(SplitMix64's output function of a key and the position), so that a
process draws only its part and any layout draws the same numbers. These
tests check the generator against SplitMix64's definition, that any part
of a draw is the same part of the whole draw, the distributions' moments,
and, on real processes, that `keras.random` under `DataParallel` on 1, 2
and 4 processes and on a (2, 2) mesh gives the same numbers, drawing only
each process' share.
"""

import random
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from keras.src.backend.torch.distributed.core import counter_draws
from keras.src.backend.torch.distributed.core import generator_states
from keras.src.backend.torch.distributed.core import random_draws
from tests.harness import run_on_ranks

_MASK = (1 << 64) - 1


def _splitmix64(key, index):
    """SplitMix64's output for counter `index` (Python integers)."""
    z = (key + (index + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def test_bits_are_splitmix64():
    """The 64 bits of each position are SplitMix64's, for any key."""
    for key in (0, 1, 123456789, (1 << 63) + 5):
        signed = key - (1 << 64) if key >= 1 << 63 else key
        index = torch.arange(50, dtype=torch.int64) * 1_000_003
        bits = counter_draws.random_bits(torch.tensor(signed), index.clone())
        got = [int(b) & _MASK for b in bits]
        assert got == [_splitmix64(key, int(i)) for i in index], key
    # The generator's published first output for seed 0.
    first = counter_draws.random_bits(torch.tensor(0), torch.tensor([0]))
    assert int(first) & _MASK == 0xE220A8397B1DCDAF


def _numpy_mixes(monkeypatch):
    """The numbers of counters `counter_draws` mixes in NumPy, call by call,
    from now on in the test."""
    mixed = []
    numpy_bits = counter_draws._numpy_bits

    def counting(*args):
        mixed.append(args[2])
        return numpy_bits(*args)

    monkeypatch.setattr(counter_draws, "_numpy_bits", counting)
    return mixed


def test_range_bits_are_splitmix64_in_numpy_and_torch(monkeypatch):
    """A range of counters mixed in NumPy (a key of Python integers on the
    CPU, below ATen's grain or on one thread) or by torch's ops (a tensor
    key, or more counters than the grain on several threads) gives
    SplitMix64's bits."""
    mixed = _numpy_mixes(monkeypatch)
    for key in (0, 123456789, -(1 << 63), (1 << 63) - 1, -98765):
        for first, count in ((0, 1), (5, 37), (1 << 40, 100)):
            expected = [
                _splitmix64(key & _MASK, first + i) for i in range(count)
            ]
            for k in (key, torch.tensor(key)):
                got = counter_draws.range_bits(k, first, count, "cpu")
                assert [int(b) & _MASK for b in got] == expected, (k, first)
    assert len(mixed) == 15  # The keys of Python integers.
    grain = counter_draws._ONE_THREAD_ELEMENTS
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    wide = counter_draws.range_bits(-98765, 3, grain, "cpu")
    assert len(mixed) == 15  # By torch's ops, on two threads.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert torch.equal(counter_draws.range_bits(-98765, 3, grain, "cpu"), wide)
    assert mixed[-1] == grain


def test_key_mix_is_the_tensor_mix():
    """A key mixed as Python integers is the tensor mix of the same int64,
    and a key of either kind draws the same bits."""
    values = [0, 1, -1, 123456789, -(1 << 63), (1 << 63) - 1]
    values += [random.Random(7).getrandbits(64) - (1 << 63) for _ in range(50)]
    tensor_mix = counter_draws.mix(torch.tensor(values, dtype=torch.int64))
    assert [counter_draws.mix_int(v) for v in values] == tensor_mix.tolist()
    index = torch.arange(20, dtype=torch.int64)
    as_int = counter_draws.random_bits(-12345, index.clone())
    as_tensor = counter_draws.random_bits(torch.tensor(-12345), index.clone())
    assert torch.equal(as_int, as_tensor)


def _tensor_key(seed):
    """The key of `draw_seed`'s values, mixed as tensors."""
    seed = seed.long()
    return int(counter_draws.mix(seed[0] * counter_draws.GAMMA + seed[1]))


def test_seed_key_advances_a_seed_generator_as_draw_seed():
    """A key of a `SeedGenerator` is the mix of what `draw_seed` gives, and
    leaves the state as `draw_seed` does: in a stateless scope (the local
    rows), outside one, and through a subclass' own `next`."""
    import keras
    from keras.src.backend.common.stateless_scope import StatelessScope
    from keras.src.random.seed_generator import draw_seed

    class Doubling(keras.random.SeedGenerator):
        def next(self, ordered=True):
            value = self.state.value * 1
            self.state.assign(value * 2 + 1)
            return value

    for kind in (keras.random.SeedGenerator, Doubling):
        ours, theirs = kind(11), kind(11)
        for _ in range(3):
            assert random_draws.seed_key(ours) == _tensor_key(draw_seed(theirs))
            assert ours.state.value.tolist() == theirs.state.value.tolist()
        with StatelessScope(
            state_mapping=[(ours.state, ours.state.value.clone())]
        ) as scope:
            key = random_draws.seed_key(ours)
            stepped = scope.get_current_value(ours.state).tolist()
        assert key == _tensor_key(draw_seed(theirs))
        assert stepped == theirs.state.value.tolist()
        assert ours.state.value.tolist() != stepped  # The scope kept it.
    assert random_draws.seed_key(5) == _tensor_key(draw_seed(5))


_BOXES = [
    ((3, 0, 0), (500, 30, 7)),  # rows from an odd position
    ((1, 0, 0), (3, 30, 7)),
    ((10, 5, 1), (50, 20, 5)),  # a box cut on every dimension
    ((0, 0, 0), (1, 1, 1)),
    ((999, 29, 6), (1, 1, 1)),  # the last element
]


@pytest.mark.parametrize("key", [7, torch.tensor(7)], ids=["int", "tensor"])
@pytest.mark.parametrize("draw", ["uniform", "normal", "keep", "uniform64"])
def test_any_part_is_that_part_of_the_whole(draw, key):
    """A box of a draw has the values of the same box of the whole draw, its
    counters mixed in NumPy (a key of Python integers) or by torch's ops."""
    shape = (1000, 30, 7)

    def drawn(offsets, local_shape):
        box = (shape, offsets, local_shape)
        if draw == "uniform":
            return counter_draws.unit_uniform(key, box, "cpu", torch.float32)
        if draw == "uniform64":
            return counter_draws.unit_uniform(key, box, "cpu", torch.float64)
        if draw == "normal":
            return counter_draws.standard_normal(key, box, "cpu", torch.float32)
        return counter_draws.keep_mask(key, box, "cpu", 0.7)

    whole = drawn((0, 0, 0), shape)
    assert tuple(whole.shape) == shape
    for offsets, local_shape in _BOXES:
        part = drawn(offsets, local_shape)
        where = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))
        assert torch.equal(part, whole[where]), (offsets, local_shape)


def test_rows_as_int32_words_are_the_per_position_halves(monkeypatch):
    """A range of positions read as the counters' int32 words (little-endian)
    gives the halves the per-position path (any byte order) gives."""
    import sys

    box = ((1000, 30, 7), (3, 0, 0), (500, 30, 7))
    words = counter_draws.draw_halves(torch.tensor(7), box, "cpu")
    monkeypatch.setattr(sys, "byteorder", "big")
    per_position = counter_draws.draw_halves(torch.tensor(7), box, "cpu")
    assert torch.equal(words.long(), per_position.long())


@pytest.mark.parametrize("byteorder", ["little", "big"])
@pytest.mark.parametrize("keep", [0.7, 1 - 2.0**-40, 2.0**-40])
def test_keep_mask_is_a_word_of_splitmix64_below_keep(
    byteorder, keep, monkeypatch
):
    """Dropout keeps position `p` where the low (even `p`) or high (odd `p`)
    32 bits of counter `p >> 1`'s SplitMix64 output, read as a signed word,
    plus 2**31 are below `keep * 2**32`: a range (read as int32 words) and
    per position alike, near 0 and 1."""
    import math
    import sys

    monkeypatch.setattr(sys, "byteorder", byteorder)
    shape, offsets, local_shape = (40, 9), (3, 0), (21, 9)
    mask = counter_draws.keep_mask(
        11, (shape, offsets, local_shape), "cpu", keep
    )
    limit = math.ceil(keep * 2**32)
    expected = []
    for row in range(offsets[0], offsets[0] + local_shape[0]):
        for p in range(row * shape[1], (row + 1) * shape[1]):
            word = _splitmix64(11, p >> 1) >> (32 * (p & 1)) & 0xFFFFFFFF
            signed = word - (1 << 32) if word >> 31 else word
            expected.append(signed + (1 << 31) < limit)
    assert mask.flatten().tolist() == expected


@pytest.mark.parametrize("threads", [1, 2])
def test_keep_scale_is_the_mask_over_keep(threads, monkeypatch):
    """Dropout's CPU factor is `keep_mask` over `keep` in the inputs' dtype,
    bit for bit: compared and scaled in NumPy (float32 and float64, words of
    a range mixed in NumPy), else by torch's ops (other dtypes, a box that
    is no range, counters past ATen's grain on several threads)."""
    mixed = _numpy_mixes(monkeypatch)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    grain = counter_draws._ONE_THREAD_ELEMENTS
    boxes = [
        ((40, 9), (3, 0), (21, 9)),  # rows from an odd position
        ((40, 9), (3, 2), (21, 5)),  # no range: per position
        ((4, grain), (1, 0), (2, grain)),  # past the grain
    ]
    for keep in (0.9, 0.75, 1 / 3, 1 - 2.0**-40):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            for box in boxes:
                scale = counter_draws.keep_scale(11, box, "cpu", keep, dtype)
                mask = counter_draws.keep_mask(11, box, "cpu", keep)
                expected = mask.to(dtype).mul_(1 / keep)
                assert scale.dtype == dtype and scale.shape == mask.shape
                assert torch.equal(scale, expected), (keep, dtype, box)
                assert torch.equal(scale != 0, mask)
    # Each range's counters (a scale's and its mask's, any dtype) mixed in
    # NumPy below the grain, past it on one thread only.
    start, count = 3 * 9, 21 * 9
    counters = (start + count + 1) // 2 - start // 2
    below = 4 * 3 * 2 * counters
    past = 4 * 3 * 2 * grain if threads == 1 else 0
    assert sum(mixed) == below + past, (sum(mixed), threads)


def _saved_for_backward(function):
    """`(what autograd saves in function(), its result)`."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = function()
    return saved, result


def test_dropout_saves_what_torchs_dropout_saves():
    """Dropout's product saves for backward what torch's own dropout saves
    on the device: on the CPU one tensor of the inputs' dtype, the mask over
    `keep`; where torch fuses dropout (an accelerator) the booleans alone.
    Either way its values and gradient are the mask's over `keep`."""
    x = torch.randn(8, 16, requires_grad=True)
    torch_saved, _ = _saved_for_backward(lambda: F.dropout(x, 0.25, True))
    saved, y = _saved_for_backward(
        lambda: random_draws.dropout(x, 0.25, None, 3)
    )
    assert [t.dtype for t in saved] == [t.dtype for t in torch_saved]
    assert [t.dtype for t in saved] == [torch.float32]
    mask = saved[0] != 0
    assert 0 < int(mask.sum()) < mask.numel()
    torch.testing.assert_close(saved[0], mask / 0.75, rtol=0, atol=0)
    torch.testing.assert_close(y, torch.where(mask, x / 0.75, 0.0))
    y.sum().backward()
    torch.testing.assert_close(x.grad, mask / 0.75)
    fused, fused_y = _saved_for_backward(
        lambda: counter_draws.masked_product(x, mask, 0.75)
    )
    assert [t.dtype for t in fused] == [torch.bool]
    torch.testing.assert_close(fused_y, y, rtol=0, atol=0)


def test_moments():
    """Uniform, normal and Bernoulli numbers with their distributions'
    moments (within 6 standard errors of a million draws)."""
    n = 1 << 20
    box = ((n,), (0,), (n,))
    bound = 6 / n**0.5
    for dtype in (torch.float32, torch.float64):
        u = counter_draws.unit_uniform(torch.tensor(3), box, "cpu", dtype)
        assert u.dtype == dtype
        assert 0 <= float(u.min()) and float(u.max()) < 1
        assert abs(float(u.mean()) - 0.5) < bound * 0.29
        assert abs(float(u.var()) - 1 / 12) < bound * 0.09
    z = counter_draws.standard_normal(
        torch.tensor(4), box, "cpu", torch.float32
    )
    assert abs(float(z.mean())) < bound
    assert abs(float(z.std()) - 1) < bound
    # Neighbours (a pair of one counter's bits) are not correlated.
    assert abs(float((z[1:] * z[:-1]).mean())) < bound
    assert abs(float((z.abs() > 2).float().mean()) - 0.0455) < 0.002
    mask = counter_draws.keep_mask(torch.tensor(5), box, "cpu", 0.9)
    assert abs(float(mask.float().mean()) - 0.9) < bound * 0.3
    # Different keys, different numbers.
    other = counter_draws.standard_normal(
        torch.tensor(5), box, "cpu", torch.float32
    )
    assert abs(float(torch.corrcoef(torch.stack([z, other]))[0, 1])) < bound


def test_no_distribution_draws_as_upstream():
    """Without a distribution the backend draws from torch's generators."""
    import keras

    keras.distribution.set_distribution(None)
    assert not random_draws.by_position()
    keras.utils.set_random_seed(1)
    first = keras.random.uniform((4, 3), seed=11)
    generator = torch.Generator().manual_seed(int(11 + 0) & 0xFFFFFFFF)
    assert torch.equal(first.cpu(), torch.rand((4, 3), generator=generator))


@pytest.mark.parametrize(
    "draw",
    [
        lambda: np.random.random(),
        # With no cached Gaussian: draws two uniforms, caches one Gaussian.
        lambda: np.random.standard_normal(),
        # 624 words: the position wraps to where it was, the key renewed.
        lambda: np.random.bytes(624 * 4),
        lambda: random.random(),
        # 624 words: Python's position wraps to where it was.
        lambda: random.getrandbits(624 * 32),
        lambda: random.seed(5),
        lambda: torch.rand(1),
    ],
    ids=[
        "numpy",
        "numpy-normal",
        "numpy-624-words",
        "python",
        "python-624-words",
        "python-reseeded",
        "torch",
    ],
)
def test_a_global_draw_is_seen_and_undone(draw):
    """A draw from a global generator between `take` and `advanced` is
    seen, nothing else is, and `restore` undoes it."""
    np.random.seed(0)
    states = generator_states.take()
    assert not generator_states.advanced(states)
    draw()
    assert generator_states.advanced(states)
    generator_states.restore(states)
    assert not generator_states.advanced(states)


def test_a_cached_gaussian_taken_alone_is_seen():
    """NumPy's second Gaussian of a pair comes from its cache, leaving the
    generator's words as they were: seen all the same."""
    np.random.seed(0)
    np.random.standard_normal()
    states = generator_states.take()
    assert not generator_states.advanced(states)
    np.random.standard_normal()
    assert generator_states.advanced(states)


def test_python_state_read_from_memory_is_its_state():
    """On CPython, Python's state is read from its generator's memory: the
    words `random.getstate()` gives, a cached Gaussian seen, and a state so
    read restores the generator exactly."""
    import sys

    random.seed(3)
    states = generator_states.take()
    python = states["python"]
    if sys.implementation.name != "cpython":
        assert python == random.getstate()
        return
    assert isinstance(python, generator_states.PythonMemory)
    words = random.getstate()[1]
    assert python.words == struct.pack("=i624I", words[-1], *words[:-1])
    random.gauss(0, 1)  # Draws two, caches the second.
    cached = generator_states.take()
    random.gauss(0, 1)  # From the cache: the words stay.
    assert cached["python"].words == generator_states.take()["python"].words
    assert generator_states.advanced(cached)
    expected = [random.random() for _ in range(700)]
    generator_states.restore(states)
    random.gauss(0, 1), random.gauss(0, 1)
    assert [random.random() for _ in range(700)] == expected


def test_python_state_taken_whole_where_memory_is_not_read(monkeypatch):
    """A global generator whose memory is not a `random.Random`'s (another
    class) is read through `getstate`, its draws seen and undone."""

    class Other(random.Random):
        pass

    other = Other(4)
    monkeypatch.setattr(random, "getstate", other.getstate)
    monkeypatch.setattr(random, "setstate", other.setstate)
    states = generator_states.take()
    assert states["python"] == other.getstate()
    other.random()
    assert generator_states.advanced(states)
    generator_states.restore(states)
    assert not generator_states.advanced(states)


def test_numpy_state_read_in_full_only_after_a_draw(monkeypatch):
    """NumPy's state is copied in full once while its generator's memory
    stays the same; a draw, a cached Gaussian or a reseed reads it again."""
    reads = []
    get_state = np.random.get_state

    def counted(*args, **kwargs):
        reads.append(1)
        return get_state(*args, **kwargs)

    monkeypatch.setattr(np.random, "get_state", counted)
    np.random.seed(0)
    for _ in range(3):
        generator_states.take()
    assert len(reads) == 1
    np.random.random()
    generator_states.take()
    assert len(reads) == 2
    np.random.standard_normal()  # A Gaussian cached: read each time.
    generator_states.take(), generator_states.take()
    assert len(reads) == 4
    np.random.seed(0)
    generator_states.take()
    assert len(reads) == 5


def test_another_global_bit_generator_is_read_in_full():
    """A global generator other than MT19937 is read through its `state`,
    its draws seen as before."""
    previous = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(0))
    try:
        states = generator_states.take()
        assert not generator_states.advanced(states)
        np.random.random()
        assert generator_states.advanced(states)
        generator_states.restore(states)
        assert not generator_states.advanced(states)
    finally:
        np.random.set_bit_generator(previous)


def test_draw_plan_follows_the_probe():
    """Later calls draw whole or as rows what the probe drew so; a shape
    that fits neither, or both, breaks the plan."""
    probe = random_draws.DrawPlan()
    assert probe.decide((4, 3), local_rows=4)  # the batch's rows
    assert not probe.decide((3,), local_rows=4)  # a constant shape
    assert probe.draws == [("rows", (3,)), ("whole", (3,))]

    later = probe.following()
    # Another order, another number of rows (a ragged last batch).
    assert not later.decide((3,), local_rows=2)
    assert later.decide((2, 3), local_rows=2)
    assert not later.broken

    unknown = probe.following()
    unknown.decide((2, 5), local_rows=2)
    assert unknown.broken
    # Rows of a process that holds 3: the probe's whole (3,) or rows (3,)?
    ambiguous = random_draws.DrawPlan()
    ambiguous.decide((4,), local_rows=4)
    ambiguous.decide((3,), local_rows=4)
    ambiguous = ambiguous.following()
    ambiguous.decide((3,), local_rows=3)
    assert ambiguous.broken


# --------------------------------------------------------------------------
# Real processes: the same numbers on any mesh
# --------------------------------------------------------------------------


def _distribution(mesh_shape):
    import keras

    devices = keras.distribution.list_devices()
    if len(mesh_shape) == 1:
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh(
        mesh_shape, ["batch", "model"], devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def _draws_body(rank, world_size, mesh_shape):
    """Draws of `keras.random` under a distribution, and what was drawn."""
    import keras

    # Unseeded draws must still agree: torch's keys and an unseeded seed
    # generator's state are process 0's.
    torch.manual_seed(rank)
    random.seed(rank)
    # Made before the distribution: its generator's state is this process'.
    early = keras.layers.Dropout(0.5)
    distribution = _distribution(mesh_shape)
    keras.distribution.set_distribution(distribution)
    numpy = keras.ops.convert_to_numpy
    generator = keras.random.SeedGenerator(7)
    out = {
        "uniform": numpy(keras.random.uniform((6, 5), seed=generator)),
        "normal": numpy(keras.random.normal((6, 5), seed=generator)),
        "truncated": numpy(
            keras.random.truncated_normal((6, 5), seed=generator)
        ),
        "randint": numpy(keras.random.randint((6, 5), 0, 10, seed=11)),
    }
    x = np.arange(1, 8 * 6 + 1, dtype="float32").reshape(8, 6)
    x = keras.distribution.distribute_tensor(
        torch.tensor(x), distribution.get_data_layout(x.shape)
    )
    drawn = []
    # The counters mixed (a key of Python integers: in NumPy).
    numpy_bits = counter_draws._numpy_bits

    def counting(key, first, count):
        drawn.append(count)
        return numpy_bits(key, first, count)

    counter_draws._numpy_bits = counting
    try:
        seeded = keras.random.dropout(
            x, 0.5, seed=keras.random.SeedGenerator(3)
        )
        out["drawn"] = list(drawn)
        unseeded = keras.random.dropout(x, 0.5)
        spatial = keras.random.dropout(x, 0.5, noise_shape=(None, 1), seed=5)
    finally:
        counter_draws._numpy_bits = numpy_bits
    late = keras.layers.Dropout(0.5)
    out["torch_keyed"] = [
        random_draws.torch_keyed(layer.seed_generator)
        for layer in (early, late)
    ]
    out["early"] = numpy(early(x, training=True))
    model_draws = _unseeded_model_draws(x)
    out["model"], out["broadcasts"], out["layers_broadcasts"] = model_draws
    out["local_rows"] = int(seeded.to_local().shape[0])
    out["dropout"] = numpy(seeded)
    out["unseeded"] = numpy(unseeded)
    out["spatial"] = numpy(spatial)
    keras.distribution.set_distribution(None)
    return out


def _unseeded_model_draws(x):
    """Models of unseeded dropouts called twice on `x`: the values and the
    broadcasts (each `async_op` or not) of the second call of two `Dropout`
    layers and a dropout without a seed, and the broadcasts of the second
    call of the two layers alone. The layers key from their generators'
    states, made from process 0's; a dropout without a seed from process
    0's torch key, started at the call and waited for at its draw."""
    import keras

    class TorchKeyedDropout(keras.layers.Layer):
        def call(self, inputs):
            return keras.random.dropout(inputs, 0.5)

    dropout = keras.layers.Dropout
    model = keras.Sequential([dropout(0.5), dropout(0.5), TorchKeyedDropout()])
    outputs, calls = _second_call(model, x)
    _, layers_calls = _second_call(keras.Sequential(model.layers[:2]), x)
    return keras.ops.convert_to_numpy(outputs), calls, layers_calls


def _second_call(model, x):
    """`model`'s second call on `x` (the first checks the local rows) and the
    broadcasts it made."""
    model(x, training=True)
    broadcast, calls = torch.distributed.broadcast, []

    def counting(*args, **kwargs):
        calls.append(kwargs.get("async_op", False))
        return broadcast(*args, **kwargs)

    torch.distributed.broadcast = counting
    try:
        outputs = model(x, training=True)
    finally:
        torch.distributed.broadcast = broadcast
    return outputs, calls


@pytest.fixture(scope="module")
def one_process():
    """The draws on one process under `DataParallel`."""
    (result,) = run_on_ranks(_draws_body, world_size=1, args=((1,),))
    return result


@pytest.mark.parametrize(
    "world_size, mesh_shape", [(2, (2,)), (4, (4,)), (4, (2, 2))]
)
def test_same_numbers_on_any_mesh(world_size, mesh_shape, one_process):
    """Every process of 2 and 4 and of a (2, 2) mesh draws one process'
    numbers, each drawing only the mask of its own rows."""
    per_rank = run_on_ranks(
        _draws_body, world_size=world_size, args=(mesh_shape,)
    )
    batch_parts = mesh_shape[0]
    for rank, result in enumerate(per_rank):
        for name in ("uniform", "normal", "truncated", "randint", "dropout"):
            np.testing.assert_array_equal(
                result[name], one_process[name], err_msg=f"{name}, {rank}"
            )
        np.testing.assert_array_equal(
            result["unseeded"], one_process["unseeded"]
        )
        np.testing.assert_array_equal(result["spatial"], one_process["spatial"])
        # A layer made before the distribution keys from process 0's torch
        # generator; one made under it, from its own generator's state.
        assert result["torch_keyed"] == [True, False]
        np.testing.assert_array_equal(result["early"], one_process["early"])
        # A model's unseeded draws: its layers' keys from their generators,
        # one key from process 0's torch generator for the call.
        np.testing.assert_array_equal(result["model"], one_process["model"])
        # On a 1-D mesh, the local rows: the key agreed during the call;
        # through DTensor on the (2, 2) mesh, at the first draw.
        started = len(mesh_shape) == 1
        assert result["broadcasts"] == [started], result["broadcasts"]
        assert result["layers_broadcasts"] == [], result["layers_broadcasts"]
        # The seeded dropout's mask: this process' rows (8 / parts), one
        # counter for two elements.
        assert result["local_rows"] == 8 // batch_parts
        assert result["drawn"] == [8 // batch_parts * 6 // 2], result["drawn"]
    assert one_process["drawn"] == [8 * 6 // 2]
    assert one_process["broadcasts"] == []
    # The model's three masks are independent (each its own key): about an
    # eighth of the elements is kept, half were the keys the same.
    kept = (one_process["model"] != 0).mean()
    assert 0 < kept < 0.3, kept
    kept = one_process["dropout"] != 0
    assert 0 < kept.mean() < 1
    # Each noise row of the spatial dropout keeps or drops a whole row.
    spatial_kept = one_process["spatial"] != 0
    assert (spatial_kept == spatial_kept[:, :1]).all()
