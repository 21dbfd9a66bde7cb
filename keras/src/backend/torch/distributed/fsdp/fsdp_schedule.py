"""The order of a step's weight gathers, learned so that the next step
gathers one layer ahead, forward and backward, as FSDP2 prefetches."""

import contextlib
import os
import threading
import weakref

GATHER_AHEAD_ENV = "KERAS_DISTRIBUTION_GATHER_AHEAD"

_running = threading.local()  # Per thread, as Keras' own state is.
# `{step function: GatherSchedule}`, kept across its steps.
_schedules = weakref.WeakKeyDictionary()


def running_schedule():
    """The `GatherSchedule` of the step running in this thread, or `None`."""
    return getattr(_running, "schedule", None)


def env_choice(name, default, choices, meaning):
    """Environment variable `name` (lower case) or `default`, which must be one
    of `choices`; `meaning` says what the first choice does, for the error."""
    choice = os.environ.get(name, default).lower()
    if choice not in choices:
        raise ValueError(
            f"{name} must be {' or '.join(map(repr, choices))} ('{choices[0]}' "
            f"{meaning}). Received: {name}={choice!r}"
        )
    return choice


def gathers_ahead(distribution):
    """Whether layer calls gather ahead: `GATHER_AHEAD_ENV` if set, else not
    on CPU meshes, where it costs memory without overlap."""
    if GATHER_AHEAD_ENV in os.environ:
        meaning = "gathers the next layer's weights ahead"
        return env_choice(GATHER_AHEAD_ENV, "", ("1", "0"), meaning) == "1"
    return distribution.device_mesh.backend_mesh.device_type != "cpu"


def step_schedule(step, distribution):
    """`following` step function `step`'s schedule, kept across its steps."""
    schedule = _schedules.get(step)
    if schedule is None:
        schedule = _schedules[step] = GatherSchedule()
    return following(schedule, distribution)


@contextlib.contextmanager
def following(schedule, distribution):
    """Makes one step's layer calls follow `schedule`."""
    schedule.ahead = gathers_ahead(distribution)
    previous, _running.schedule = running_schedule(), schedule
    try:
        yield
    finally:
        _running.schedule = previous
        schedule.finish_step()


class GatherSchedule:
    """A step's weight gathers in order, the same on every process so async
    gathers pair up, for the next step to gather ahead."""

    def __init__(self, ahead=True):
        self.ahead = ahead
        # Weak references to the previous (`_order`) and this step's layers;
        # `(weak reference to its layer, call)` gathered ahead; this step's
        # calls freed after the forward pass, in call order.
        self._order, self._calls, self._ahead, self._released = [], [], None, []

    def take_ahead(self, layer, call):
        """Gives `call` (of `layer`) its prefetch; returns whether it was the
        previous step's last gather, which keeps its weights: the backward
        pass starts with it."""
        self._calls.append(weakref.ref(layer))
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0]() is not layer:
            ahead[1].drop_ahead()
            ahead = None
        call.take(None if ahead is None else ahead[1])
        order = self._order
        return len(self._calls) == len(order) and order[-1]() is layer

    def gather_ahead(self, layer, call_of):
        """Starts gathering the weights of the call after `layer`'s; `call_of`
        maps a layer to what its call gathers (`gather_ahead`, `drop_ahead`)."""
        position = len(self._calls)
        if (
            not self.ahead
            or position >= len(self._order)
            or self._order[position - 1]() is not layer
            or (following := self._order[position]()) is None
        ):
            return
        call = call_of(following)
        if call is not None:
            call.gather_ahead()
            self._ahead = (weakref.ref(following), call)

    def released(self, call=None):
        """Records a call freed after the forward pass (`None`: the last, which
        kept its weights); returns a function that, in backward, gathers the
        call released before it (or `None`)."""
        if not self.ahead:
            return None
        index = len(self._released)
        if call is not None:
            self._released.append(call)
        return lambda: any(
            c.restore_ahead() for c in reversed(self._released[:index])
        )

    def finish_step(self):
        """Drops unused gathers and keeps this step's order for the next."""
        if self._ahead is not None:
            self._ahead[1].drop_ahead()
            self._ahead = None
        for call in self._released:
            call.drop_ahead()
        self._released = []
        self._order, self._calls = self._calls, []
