"""Values drawn by position from a key: element `p` of a draw takes one
32-bit word of counter `p >> 1`'s SplitMix64 output, the mix of
`key + (p >> 1) * GAMMA + GAMMA` (`unit_uniform` and `standard_normal` 24
of its bits, `keep_mask` all 32); a float64 uniform takes 53 bits of
counter `p`'s. A process draws any box of a draw's global shape, with the
values of that box of the whole draw."""

import math
import sys

import numpy as np
import torch

from keras.src.backend.torch.distributed.core import layouts

# SplitMix64's constants as signed int64 (torch's int64 wraps modulo 2**64).
GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)
# SplitMix64's output function: `z ^= z >> shift` (logical), then `z *=
# factor` but in the last round.
_ROUNDS = ((30, _MIX_1), (27, _MIX_2), (31, None))
_MASK = (1 << 64) - 1
# The bit offsets of a counter's two 24-bit halves (`draw_halves`).
_HALVES = (8, 40)
_HALF_MASK = (1 << 24) - 1
# Below this many elements a torch op on the CPU runs on one thread (ATen's
# parallel grain): counters of a range fewer than this are mixed in NumPy.
_ONE_THREAD_ELEMENTS = 32768
# `mix`'s constants as NumPy uint64 (`_numpy_bits`): `(shift, factor)`s.
_NUMPY_GAMMA = np.uint64(GAMMA & _MASK)
_NUMPY_ROUNDS = tuple(
    (np.uint64(bits), None if factor is None else np.uint64(factor & _MASK))
    for bits, factor in _ROUNDS
)
# `_gamma_steps`' array: the steps of the most counters drawn so far.
_GAMMA_STEPS = [np.zeros(0, dtype=np.uint64)]
# The dtypes `keep_scale` makes in NumPy, as NumPy's.
_NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}


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


def pair_key(first, second):
    """The int64 key of two int64 values (a seed's, or a key and the number
    of a key derived from it): the mix of `first * GAMMA + second`, as
    Python integers or by torch's ops on 0-d tensors."""
    if isinstance(first, torch.Tensor):
        return mix(first * GAMMA + second)
    return mix_int(first * GAMMA + second)


def random_bits(key, index):
    """64 random bits (int64) per flat position of `index` (overwritten):
    the mix of `key + (index + 1) * GAMMA`."""
    if isinstance(key, torch.Tensor):
        first = key + GAMMA  # A 0-d int64 op: wraps as the elements do.
    else:
        first = ((key + GAMMA + (1 << 63)) & _MASK) - (1 << 63)
    return mix(index.mul_(GAMMA).add_(first))


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
    if _in_numpy(key, count, device):
        return torch.from_numpy(_numpy_bits(key, first, count))
    index = torch.arange(first, first + count, device=device)
    return random_bits(key, index)


def _in_numpy(key, count, device):
    """Whether `range_bits` mixes `count` counters in NumPy."""
    return (
        isinstance(key, int)
        and torch.device(device).type == "cpu"
        and (count < _ONE_THREAD_ELEMENTS or torch.get_num_threads() == 1)
        and not torch.compiler.is_compiling()
    )


def _numpy_bits(key, first, count):
    """`random_bits` of the counters `[first, first + count)` as NumPy int64:
    SplitMix64 in uint64, which wraps and shifts as its definition does."""
    # Counter `first + i`'s input is `i * GAMMA` plus that of `first`.
    z = np.add(
        _gamma_steps(count), np.uint64((key + (first + 1) * GAMMA) & _MASK)
    )
    shifted = np.empty_like(z)
    for bits, factor in _NUMPY_ROUNDS:
        np.right_shift(z, bits, out=shifted)
        z ^= shifted
        if factor is not None:
            z *= factor
    return z.view(np.int64)


def _gamma_steps(count):
    """`i * GAMMA` for `i` in `[0, count)` as NumPy uint64; below ATen's
    grain a slice of one array, grown to the most counters drawn."""
    if count >= _ONE_THREAD_ELEMENTS:
        return np.arange(count, dtype=np.uint64) * _NUMPY_GAMMA
    steps = _GAMMA_STEPS[0]
    if steps.size < count:
        steps = np.arange(count, dtype=np.uint64) * _NUMPY_GAMMA
        _GAMMA_STEPS[0] = steps
    return steps[:count]


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
    words = _numpy_words(key, box, device)
    if words is not None:
        return torch.from_numpy(words.reshape(box[2]))
    return _torch_words(key, box, device)


def _torch_words(key, box, device):
    """`draw_words` of `box` by torch's ops."""
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


def _numpy_words(key, box, device):
    """`draw_words` of `box` as NumPy int32 (of the flat box) where they are
    a range of positions whose counters `range_bits` mixes in NumPy, on a
    little-endian host (each counter's low word, then its high word); else
    `None`."""
    span = _span(box)
    if span is None or sys.byteorder != "little":
        return None
    start, count = span
    first, end = start >> 1, (start + count + 1) >> 1
    if not _in_numpy(key, end - first, device):
        return None
    words = _numpy_bits(key, first, end - first).view(np.int32)
    return words[start & 1 : (start & 1) + count]


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
    kept = _numpy_kept(key, box, device, keep)
    if kept is None:
        return _torch_words(key, box, device) <= _keep_limit(keep)
    return torch.from_numpy(kept)


def keep_scale(key, box, device, keep, dtype):
    """`keep_mask` over `keep`, of `dtype`: the factor torch's CPU dropout
    multiplies by and saves. Compared and scaled in NumPy where its words
    are NumPy's (one op each where torch's would cost several times more on
    so few elements)."""
    numpy_dtype = _NUMPY_FLOATS.get(dtype)
    kept = _numpy_kept(key, box, device, keep)
    if kept is None:
        mask = _torch_words(key, box, device) <= _keep_limit(keep)
    elif numpy_dtype is None:
        mask = torch.from_numpy(kept)
    else:
        scale = np.multiply(kept, numpy_dtype(1 / keep), dtype=numpy_dtype)
        return torch.from_numpy(scale)
    return mask.to(dtype).mul_(1 / keep)


def _numpy_kept(key, box, device, keep):
    """`keep_mask` as NumPy booleans of `box`'s shape where its words are
    NumPy's (`_numpy_words`), else `None`."""
    words = _numpy_words(key, box, device)
    if words is None:
        return None
    return np.less_equal(words, _keep_limit(keep)).reshape(box[2])


def _keep_limit(keep):
    """The largest signed word `keep_mask` keeps."""
    return math.ceil(float(keep) * 2**32) - 2**31 - 1


def standard_normal(key, box, device, dtype):
    """Standard normals by position (Box-Muller on each counter's pair)."""

    def pair(low, high):
        work = torch.float64 if dtype == torch.float64 else torch.float32
        radius = (low.to(work) + 1).mul_(2.0**-24).log_().mul_(-2.0).sqrt_()
        angle = high.to(work).mul_(2.0**-24 * 2 * torch.pi)
        return radius * angle.cos(), radius.mul_(angle.sin_())

    return draw_pairs(key, box, device, pair)


def masked_product(inputs, factor, keep):
    """`inputs * mask / keep` from dropout's `factor`, saving for backward
    what torch's dropout saves on the device: on the CPU the scale
    (`keep_scale`: one op in backward), where torch fuses dropout (an
    accelerator) the booleans of `keep_mask`."""
    if factor.dtype == torch.bool:
        return inputs * factor * (1 / keep)
    return inputs * factor
