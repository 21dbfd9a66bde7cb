"""The order of a step's gathers, to gather each layer's weights ahead.

`fsdp` gathers a layer's weights sharded over the batch axis when the
layer is called, and again when the backward pass reaches it. Within a
step, a `GatherSchedule` lets each of those gathers start while the layer
before it computes, as FSDP2 prefetches: it learns the order of the step's
gathers, and the next step issues the gather of the following layer
asynchronously as a layer is called; in the backward pass, the gradient
that gathers a layer's weights again also starts the gather of the layer
before it. At most one layer's gather is ahead, forward or backward.

It costs memory (one more layer's gathered weights, and the collective's
buffers) for the overlap of communication with compute: on by default on
CUDA devices, off on CPUs (see `gathers_ahead`).

The order also tells which call is the step's last to gather, ahead or
not: the backward pass starts with it, so its weights are kept, not freed
and gathered again at once (one all-gather fewer a step).
"""

import contextlib
import os
import threading
import weakref

import numpy as np

GATHER_AHEAD_ENV = "KERAS_DISTRIBUTION_GATHER_AHEAD"

# Per thread, as Keras' own state is: the `GatherSchedule` of the step
# running in this thread (see `following`).
_running = threading.local()


def running_schedule():
    """The `GatherSchedule` of the step running in this thread, or `None`."""
    return getattr(_running, "schedule", None)


def gathers_ahead(distribution):
    """Whether a step's layer calls gather their weights ahead.

    On CUDA devices, collectives run on a stream of their own and overlap
    compute; on CPU processes (gloo), measured on 2 cores
    (`benchmarks/bench_fsdp.py`), gathering ahead held 1.4x the gathered
    memory for a step 0.97-1.04x as long, so it is off there.

    Args:
        distribution: the distribution in effect.

    Returns:
        A `bool`: `KERAS_DISTRIBUTION_GATHER_AHEAD` (`"1"` or `"0"`) if
        set, else whether the mesh's devices are not CPUs.
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
    """Lets the layer calls of one step follow `schedule`: the step's
    last call keeps its gathered weights for the backward pass, and, if
    `gathers_ahead(distribution)`, each call gathers the next one's
    weights ahead.

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

    A step records the order of its gathers; the next step follows it to
    gather each layer's weights while the layer before computes. The order
    is the same on every process (the same model, called the same way), so
    the asynchronous gathers are issued in the same order everywhere. A
    weight gathered ahead stands for its variable only in the call it was
    gathered for, with the same placements, dtype and gradient mode and an
    unchanged variable; otherwise it is dropped once its gather completes,
    and the call gathers anew (a call order that changed: a layer called
    conditionally).
    """

    def __init__(self, ahead=True):
        # Whether calls gather the next call's weights ahead.
        self.ahead = ahead
        # The previous step's layer calls that gathered, as weak references.
        self._order = []
        self._calls = []
        # The call gathered ahead: `(weak reference to its layer, call)`.
        self._ahead = None
        # This step's calls whose gathered storage was freed after the
        # forward pass, in call order.
        self._released = []

    def take_ahead(self, layer, call):
        """Gives `call` (of `layer`) what was gathered ahead for it.

        Returns:
            The call's position in the step's order of calls.
        """
        self._calls.append(weakref.ref(layer))
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0]() is not layer:
            ahead[1].drop_ahead()
            ahead = None
        call.take(None if ahead is None else ahead[1])
        return len(self._calls) - 1

    def is_last(self, position, layer):
        """Whether the call of `layer` at `position` was the last to gather
        in the previous step: the backward pass starts with it, so freeing
        its weights would only gather them again at once (FSDP2 keeps its
        root module's parameters for the same reason).

        Args:
            position: what `take_ahead` returned for the call.
            layer: the layer called.
        """
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
            A function that, in the backward pass, starts gathering again
            the weights of the call released before this one, or `None`
            when calls do not gather ahead.
        """
        if not self.ahead:
            return None
        self._released.append(call)
        index = len(self._released) - 1
        return lambda: self._restore_ahead(index)

    def kept(self):
        """Records that the step's last call kept its gathered weights.

        Returns:
            A function that, in the backward pass, starts gathering again
            the weights of the call released before it, or `None` when
            calls do not gather ahead.
        """
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
        """Drops what was gathered for calls that did not come, and keeps
        this step's order for the next."""
        if self._ahead is not None:
            self._ahead[1].drop_ahead()
            self._ahead = None
        for call in self._released:
            call.drop_ahead()
        self._released = []
        self._order, self._calls = self._calls, []
