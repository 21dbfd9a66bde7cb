"""The states of torch's, Python's and NumPy's global generators, which a call
on local rows must leave as found, or advance as a call on the global batch."""

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
    `take`), but `torch_keys` keys and, if `python_draws`, Python's/NumPy's."""
    now, expected = take(), dict(states)
    if torch_keys:
        torch.set_rng_state(states["cpu"])
        for _ in range(torch_keys):
            torch_key()
        expected["cpu"] = torch.get_rng_state()
        torch.set_rng_state(now["cpu"])
    if python_draws:
        now["python"], now["numpy"] = states["python"], states["numpy"]
    return differ(expected, now)


def python_advanced(before, after):
    """Whether Python's or NumPy's generator moved between two `take`s."""
    a, b = before["numpy"], after["numpy"]
    return (  # NumPy's state holds an array: `==` on it is ambiguous.
        before["python"] != after["python"]
        or (a["state"]["pos"], a["has_gauss"], a["gauss"])
        != (b["state"]["pos"], b["has_gauss"], b["gauss"])
        or not np.array_equal(a["state"]["key"], b["state"]["key"])
    )


def differ(a, b):
    """Whether two states of `take` differ."""
    return (
        not torch.equal(a["cpu"], b["cpu"])
        or python_advanced(a, b)
        or "cuda" in a
        and any(not torch.equal(x, y) for x, y in zip(a["cuda"], b["cuda"]))
    )
