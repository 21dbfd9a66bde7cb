"""What a process reports to the job's store is true of its current step.

`health` writes a process' error to the job's store for the others to
read when their collective fails. A process whose caller caught that
error and went on must not leave it there: a later failure elsewhere
would name the old error as its cause.
"""

import datetime

import pytest
import torch.distributed as dist

from keras.src.backend.torch.distributed.health import health


@pytest.fixture
def store(monkeypatch):
    server = dist.TCPStore(
        "127.0.0.1",
        0,  # A free port, picked by the store.
        is_master=True,
        timeout=datetime.timedelta(seconds=5),
    )
    monkeypatch.setitem(health._state, "store", server)
    monkeypatch.setitem(health._state, "written", [])
    monkeypatch.setitem(health._state, "steps", {})
    # Process 1 of 2 reports; no process group is needed for that.
    monkeypatch.setattr(health, "_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    return server


def test_a_report_of_an_earlier_step_is_cleared_by_the_next_step(store):
    with pytest.raises(ValueError):
        with health.guarded_step("train", lambda: []):
            raise ValueError("boom in step 1")
    assert health._report("failed/1") == "ValueError: boom in step 1"
    # The caller caught it and trains on: the report is gone at once.
    with health.guarded_step("train", lambda: []):
        assert health._store_get("failed/1") is None
    assert health._state["written"] == []


def test_a_step_of_a_process_that_never_reported_touches_no_key(store):
    store.set("failed/0", "another process' report")
    with health.guarded_step("train", lambda: []):
        pass
    assert health._store_get("failed/0") == "another process' report"


def test_a_report_of_a_step_its_process_went_on_from_is_not_current(
    store, monkeypatch
):
    # Process 1 fails in its train step 1; its caller catches it and goes
    # on, but has not started its next step (which clears the report) when
    # process 0, already in train step 2, asks whether a peer failed.
    with pytest.raises(ValueError):
        with health.guarded_step("train", lambda: []):
            raise ValueError("boom in step 1")
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    health._state["steps"] = {"train": 2}
    assert health.peer_failures() == []
    # Asked in the step the failure happened in, it is one; and a failed
    # collective's message still names it.
    health._state["steps"] = {"train": 1}
    assert health.peer_failures() == [(1, "ValueError: boom in step 1")]
    health._state["steps"] = {"train": 2}
    assert health._reports() == {1: ("ValueError: boom in step 1", None)}
    # A report of another kind of step than this process has run is current.
    health._state["steps"] = {"test": 4}
    assert health.peer_failures() == [(1, "ValueError: boom in step 1")]
