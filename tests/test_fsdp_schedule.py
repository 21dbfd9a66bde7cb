"""The order of a step's weight gathers, replayed by the next step.

`fsdp_schedule` alone, in one process, with stand-ins for layers and
gathered weights: what the next call gathers ahead, what it takes, what is
dropped. The gathers themselves, on real ranks: `tests/test_fsdp.py`.
"""

import types

import pytest

from keras.src.backend.torch.distributed.fsdp import fsdp_schedule


class _Layer:
    def __init__(self, name, call=None):
        self.name = name
        self.call = call


class _Call:
    """Records what the schedule asks of a layer call's gathered weights."""

    def __init__(self, name, log):
        self.name = name
        self.log = log

    def take(self, ahead):
        self.log.append(("take", self.name, ahead is not None))

    def gather_ahead(self):
        self.log.append(("gather_ahead", self.name))

    def drop_ahead(self):
        self.log.append(("drop_ahead", self.name))


def _step(schedule, layers):
    for layer in layers:
        schedule.take_ahead(layer, layer.call)
        schedule.gather_ahead(layer, lambda following: following.call)
    schedule.finish_step()


def _after_one_step():
    """A schedule that recorded one step of two layer calls, and its log
    (cleared), its layers."""
    log = []
    first = _Layer("first", _Call("a", log))
    second = _Layer("second", _Call("b", log))
    schedule = fsdp_schedule.GatherSchedule()
    _step(schedule, [first, second])
    # The first step has no order to follow: nothing is gathered ahead.
    assert ("gather_ahead", "b") not in log
    assert ("take", "b", False) in log
    log.clear()
    return schedule, log, first, second


def test_the_next_step_gathers_each_call_ahead_in_the_recorded_order():
    schedule, log, first, second = _after_one_step()
    _step(schedule, [first, second])
    assert log.index(("gather_ahead", "b")) < log.index(("take", "b", True))
    assert ("drop_ahead", "b") not in log


def test_a_call_that_does_not_come_drops_what_was_gathered_for_it():
    schedule, log, first, _ = _after_one_step()
    # This step calls only `first`: `second`'s gather ahead is dropped.
    _step(schedule, [first])
    assert ("gather_ahead", "b") in log
    assert log[-1] == ("drop_ahead", "b")


def _distribution(device_type):
    backend_mesh = types.SimpleNamespace(device_type=device_type)
    mesh = types.SimpleNamespace(backend_mesh=backend_mesh)
    return types.SimpleNamespace(device_mesh=mesh)


def test_gathering_ahead_is_chosen_by_device_unless_set(monkeypatch):
    monkeypatch.delenv(fsdp_schedule.GATHER_AHEAD_ENV, raising=False)
    assert not fsdp_schedule.gathers_ahead(_distribution("cpu"))
    assert fsdp_schedule.gathers_ahead(_distribution("cuda"))
    monkeypatch.setenv(fsdp_schedule.GATHER_AHEAD_ENV, "1")
    assert fsdp_schedule.gathers_ahead(_distribution("cpu"))
    monkeypatch.setenv(fsdp_schedule.GATHER_AHEAD_ENV, "yes")
    with pytest.raises(ValueError, match="must be '1'"):
        fsdp_schedule.gathers_ahead(_distribution("cpu"))
