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
    assert health._store_get("failed/1") == "ValueError: boom in step 1"
    # The caller caught it and trains on: the report is gone at once.
    with health.guarded_step("train", lambda: []):
        assert health._store_get("failed/1") is None
    assert health._state["written"] == []


def test_a_step_of_a_process_that_never_reported_touches_no_key(store):
    store.set("failed/0", "another process' report")
    with health.guarded_step("train", lambda: []):
        pass
    assert health._store_get("failed/0") == "another process' report"
