"""The order of a step's gathers, to gather each layer's weights ahead.

`fsdp` gathers a layer's batch-sharded weights when it is called and in the
backward pass. As FSDP2 prefetches, a `GatherSchedule` learns a step's order
of gathers so the next step gathers one layer ahead, forward and backward.
"""

import contextlib
import os
import threading
import weakref

import numpy as np

GATHER_AHEAD_ENV = "KERAS_DISTRIBUTION_GATHER_AHEAD"

# Per thread, as Keras' own state is.
_running = threading.local()


def running_schedule():
    """The `GatherSchedule` of the step running in this thread, or `None`."""
    return getattr(_running, "schedule", None)


def gathers_ahead(distribution):
    """Whether a step's layer calls gather their weights ahead.

    `KERAS_DISTRIBUTION_GATHER_AHEAD` (`"1"`/`"0"`) if set, else off on CPU
    meshes, where gathering ahead costs memory without overlapping compute.

    Args:
        distribution: the distribution in effect.
    """
    choice = os.environ.get(GATHER_AHEAD_ENV)
    if choice is None:
        device = str(np.asarray(distribution.device_mesh.devices).flat[0])
        return not device.lower().startswith("cpu")
    if choice not in ("0", "1"):
        raise ValueError(
            f"{GATHER_AHEAD_ENV} must be '1' (gather the next layer's "
            f"weights ahead) or '0'. Received: {GATHER_AHEAD_ENV}={choice!r}"
        )
    return choice == "1"


@contextlib.contextmanager
def following(schedule, distribution):
    """Makes one step's layer calls follow `schedule`.

    Args:
        schedule: the step's `GatherSchedule`.
        distribution: the distribution in effect.
    """
    schedule.ahead = gathers_ahead(distribution)
    previous = running_schedule()
    _running.schedule = schedule
    try:
        yield
    finally:
        _running.schedule = previous
        schedule.finish_step()


class GatherSchedule:
    """The order in which a step function's layer calls gather weights.

    The order is the same on every process, so async gathers are issued in
    the same order everywhere. A weight gathered ahead is dropped unless the
    call, placements, dtype, gradient mode and variable are unchanged.
    """

    def __init__(self, ahead=True):
        self.ahead = ahead
        # Weak references to the previous (`_order`) and this step's layers.
        self._order = []
        self._calls = []
        # `(weak reference to its layer, call)` gathered ahead.
        self._ahead = None
        # This step's calls freed after the forward pass, in call order.
        self._released = []

    def take_ahead(self, layer, call):
        """Gives `call` (of `layer`) what was gathered ahead for it, and
        returns the call's position in the step's order."""
        self._calls.append(weakref.ref(layer))
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0]() is not layer:
            ahead[1].drop_ahead()
            ahead = None
        call.take(None if ahead is None else ahead[1])
        return len(self._calls) - 1

    def is_last(self, position, layer):
        """Whether the call of `layer` at `position` (from `take_ahead`) was
        the previous step's last to gather: the backward pass starts with it,
        so it keeps its weights."""
        return position == len(self._order) - 1 and (
            self._order[position]() is layer
        )

    def gather_ahead(self, layer, call_of):
        """Starts gathering the weights of the call after `layer`'s.

        Args:
            layer: the layer being called.
            call_of: a function of a layer: what a call of it gathers (an
                object with `gather_ahead` and `drop_ahead`), or `None`.
        """
        if not self.ahead:
            return
        position = len(self._calls)
        if position >= len(self._order) or self._order[position - 1]() is not (
            layer
        ):
            return
        following = self._order[position]()
        if following is None:
            return
        call = call_of(following)
        if call is not None:
            call.gather_ahead()
            self._ahead = (weakref.ref(following), call)

    def released(self, call):
        """Records a call whose weights were freed after the forward pass.

        Returns:
            A function that, in the backward pass, starts gathering the
            previously released call's weights, or `None` if not `ahead`.
        """
        if not self.ahead:
            return None
        self._released.append(call)
        index = len(self._released) - 1
        return lambda: self._restore_ahead(index)

    def kept(self):
        """Records that the step's last call kept its gathered weights;
        returns as `released`."""
        if not self.ahead:
            return None
        index = len(self._released)
        return lambda: self._restore_ahead(index)

    def _restore_ahead(self, index):
        for call in reversed(self._released[:index]):
            if call.needs_restore():
                call.restore_ahead()
                return

    def finish_step(self):
        """Drops unused gathers and keeps this step's order for the next."""
        if self._ahead is not None:
            self._ahead[1].drop_ahead()
            self._ahead = None
        for call in self._released:
            call.drop_ahead()
        self._released = []
        self._order, self._calls = self._calls, []
