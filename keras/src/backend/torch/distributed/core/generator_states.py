"""The states of torch's, Python's and NumPy's global generators, which a call
on local rows must leave as found, or advance as a call on the global batch."""

import collections
import ctypes
import random
import struct
import sys

import numpy as np
import torch

# NumPy's MT19937 state in memory: 624 words, then the next word's position.
_MT_BYTES = 624 * 4 + 4
# `[bit generator, a view of its state's memory if it holds MT19937's
# layout (else `None`)]`, checked once; the view lives as the generator.
_LAYOUT = [None, None]
_GET_BIT_GENERATOR = getattr(np.random, "get_bit_generator", None)
# NumPy's global state as last read in full: `[its memory, its state]`.
_LAST_NUMPY = [None, None]
# CPython's `random.Random` after its object header: the next word's
# position, then 624 words.
_PYTHON_FORMAT = "=i624I"
_PYTHON_BYTES = struct.calcsize(_PYTHON_FORMAT)
# `[Python's global generator, a view of its memory if it holds that layout
# (else `None`)]`, checked once.
_PYTHON_LAYOUT = [None, None]
# Python's global state as read from memory, in place of `random.getstate()`.
PythonMemory = collections.namedtuple("PythonMemory", ["words", "gauss_next"])


def take():
    """The states of the global generators (torch's as bytes: compared in a
    fraction of `torch.equal`'s time)."""
    states = {
        "cpu": _bytes(torch.default_generator.get_state()),
        "python": _python_state(),
        "numpy": _numpy_state(),
    }
    if torch.cuda.is_initialized():  # Only then can CUDA's have drawn.
        states["cuda"] = [_bytes(x) for x in torch.cuda.get_rng_state_all()]
    return states


def _bytes(state):
    """A generator's state tensor as bytes."""
    return state.numpy().tobytes()


def _tensor(state):
    """The state tensor of `_bytes`' `state`."""
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def _python_state():
    """Python's global state: its words as bytes and its cached Gaussian
    (a `PythonMemory`) where CPython's layout holds, else `random.getstate()`
    (building 625 integers)."""
    generator = random.getstate.__self__
    if generator is not _PYTHON_LAYOUT[0]:
        view = _python_view(generator) if _python_layout(generator) else None
        _PYTHON_LAYOUT[:] = [generator, view]
    if _PYTHON_LAYOUT[1] is None:
        return random.getstate()
    return PythonMemory(_PYTHON_LAYOUT[1].tobytes(), generator.gauss_next)


def _memory_view(address, size):
    """A view of `size` bytes of memory at `address` (an object's, which must
    outlive it), read by `tobytes` in a fraction of `ctypes.string_at`'s
    time."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def _python_view(generator):
    """A view of `generator`'s Mersenne Twister after its object header (`id`
    is the object's address in CPython)."""
    return _memory_view(id(generator) + object.__basicsize__, _PYTHON_BYTES)


def _python_layout(generator):
    """Whether `generator` is a `random.Random` of CPython holding its state
    as `_PYTHON_FORMAT` describes, checked on a fresh one before and after a
    draw."""
    if sys.implementation.name != "cpython":
        return False
    if type(generator) is not random.Random:
        return False
    fresh = random.Random(0)

    def held():
        words = fresh.getstate()[1]
        expected = struct.pack(_PYTHON_FORMAT, words[-1], *words[:-1])
        return _python_view(fresh).tobytes() == expected

    first = held()
    fresh.random()
    return first and held()


def _set_python_state(state):
    """Sets Python's global generator to `state` (of `_python_state`)."""
    if isinstance(state, PythonMemory):
        index, *words = struct.unpack(_PYTHON_FORMAT, state.words)
        version = random.getstate.__self__.VERSION
        state = (version, tuple(words) + (index,), state.gauss_next)
    random.setstate(state)


def _numpy_state():
    """NumPy's global state, read in full (624 words copied in Python) only if
    its generator's memory changed since the last full read. Equal memory is
    the same state where no normal deviate was cached then: caching one draws
    from the generator (only `set_state` caches one without)."""
    memory = _numpy_memory()
    last_memory, last_state = _LAST_NUMPY
    if memory is not None and memory == last_memory:
        if not last_state["has_gauss"]:
            return last_state
    state = np.random.get_state(legacy=False)
    _LAST_NUMPY[:] = [memory, state]
    return state


def _numpy_memory():
    """The bytes of NumPy's global MT19937 state, or `None` if its memory
    does not hold the layout `_MT_BYTES` describes."""
    bits = _GET_BIT_GENERATOR and _GET_BIT_GENERATOR()
    if bits is None:
        return None
    if bits is not _LAYOUT[0]:
        view = None
        if _mt19937_layout(bits):
            view = _memory_view(bits.ctypes.state_address, _MT_BYTES)
        _LAYOUT[:] = [bits, view]
    if _LAYOUT[1] is None:
        return None
    return _LAYOUT[1].tobytes()


def _mt19937_layout(global_bits):
    """Whether `global_bits` is an MT19937 holding its state as `_MT_BYTES`
    describes, checked on a fresh one before and after a draw."""
    if type(global_bits) is not np.random.MT19937:
        return False
    bits = np.random.MT19937(0)

    def held():
        state = bits.state["state"]
        pos = int(state["pos"]).to_bytes(4, sys.byteorder, signed=True)
        memory = _memory_view(bits.ctypes.state_address, _MT_BYTES).tobytes()
        return memory == state["key"].astype(np.uint32).tobytes() + pos

    first = held()
    bits.random_raw()
    return first and held()


def restore(states):
    """Sets the global generators to `states` (of `take`)."""
    torch.set_rng_state(_tensor(states["cpu"]))
    _set_python_state(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all([_tensor(x) for x in states["cuda"]])


def torch_key():
    """A key for a draw by position, from torch's CPU generator."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


def advanced(states, python_draws=False):
    """Whether a random op drew from a global generator since `states` (of
    `take`), but, if `python_draws`, Python's/NumPy's."""
    now = take()
    if python_draws:
        now["python"], now["numpy"] = states["python"], states["numpy"]
    return differ(states, now)


def python_advanced(before, after):
    """Whether Python's or NumPy's generator moved between two `take`s."""
    return before["python"] != after["python"] or not _same(
        before["numpy"], after["numpy"]
    )


def _same(a, b):
    """Whether two NumPy states (nested dicts holding arrays) are equal."""
    if a is b:
        return True
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):  # `==` on an array is ambiguous.
        return np.array_equal(a, b)
    return a == b


def differ(a, b):
    """Whether two states of `take` differ."""
    return (
        a["cpu"] != b["cpu"]
        or python_advanced(a, b)
        or "cuda" in a
        and a["cuda"] != b["cuda"]
    )
