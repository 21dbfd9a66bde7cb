"""The states of torch's, Python's and NumPy's global generators: a dropped
layer call on local rows must leave them as it found them; a kept one must
draw what a call on the global batch draws."""

import random

import numpy as np
import torch


def take():
    """The states of the global generators."""
    states = {
        "cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=False),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore(states):
    """Sets the global generators to `states` (of `take`)."""
    torch.set_rng_state(states["cpu"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def torch_key():
    """A key for a draw by position, from torch's CPU generator."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


def advanced(states, torch_keys=0, python_draws=False):
    """Whether a random op drew from a global generator since `states` (of
    `take`), not counting `torch_keys` keys drawn meanwhile, nor Python's and
    NumPy's draws if `python_draws`."""
    expected = _cpu_state_after_keys(states["cpu"], torch_keys)
    if not torch.equal(expected, torch.get_rng_state()):
        return True
    if not python_draws and python_advanced(states, take()):
        return True
    return "cuda" in states and any(
        not torch.equal(a, b)
        for a, b in zip(states["cuda"], torch.cuda.get_rng_state_all())
    )


def python_advanced(before, after):
    """Whether Python's or NumPy's generator moved between two `take`s."""
    return before["python"] != after["python"] or not _same_numpy_state(
        before["numpy"], after["numpy"]
    )


def differ(a, b):
    """Whether two states of `take` differ."""
    if not torch.equal(a["cpu"], b["cpu"]) or python_advanced(a, b):
        return True
    return "cuda" in a and any(
        not torch.equal(x, y) for x, y in zip(a["cuda"], b["cuda"])
    )


def _cpu_state_after_keys(state, count):
    """torch's CPU generator state after `count` keys drawn from `state`."""
    if not count:
        return state
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    for _ in range(count):
        torch_key()
    expected = torch.get_rng_state()
    torch.set_rng_state(current)
    return expected


def _same_numpy_state(a, b):
    # The Mersenne Twister state holds an array: `==` on it is ambiguous.
    return (
        a["state"]["pos"] == b["state"]["pos"]
        and a["has_gauss"] == b["has_gauss"]
        and a["gauss"] == b["gauss"]
        and np.array_equal(a["state"]["key"], b["state"]["key"])
    )
