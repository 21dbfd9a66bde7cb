"""Which directories are checkpoints, and which step a path names.

`checkpoint`'s directory logic alone, in one process, on directories laid
out by hand: a step is complete once both its DCP metadata and its Keras
info file are written; an interrupted save (a `.partial-` directory, a
step without metadata) is never loaded. Saving and loading on real ranks:
`tests/test_distributed_checkpoint.py`.
"""

import pytest

from keras.src.backend.torch.distributed.checkpoints import checkpoint


def _step(directory, name, complete=True):
    step = directory / name
    step.mkdir()
    (step / checkpoint.INFO_FILE).write_text("{}")
    if complete:
        (step / checkpoint.METADATA_FILE).write_text("")
    return step


def test_a_directory_of_steps_names_its_latest_complete_step(tmp_path):
    _step(tmp_path, "1")
    _step(tmp_path, "2")
    _step(tmp_path, "3", complete=False)
    (tmp_path / "notes").mkdir()
    assert checkpoint.is_checkpoint(tmp_path)
    assert checkpoint.complete_steps(tmp_path) == [1, 2]
    assert checkpoint.resolve(tmp_path) == str(tmp_path / "2")
    assert checkpoint.resolve(tmp_path / "1") == str(tmp_path / "1")


def test_an_interrupted_save_is_never_loaded(tmp_path):
    incomplete = _step(tmp_path, "1", complete=False)
    with pytest.raises(ValueError, match="is incomplete"):
        checkpoint.resolve(incomplete)
    with pytest.raises(ValueError, match="No complete checkpoint"):
        checkpoint.resolve(tmp_path)
    # A save still in progress marks the directory as a checkpoint's.
    other = tmp_path / "other"
    other.mkdir()
    assert not checkpoint.is_checkpoint(other)
    (other / f"{checkpoint.PARTIAL_PREFIX}1").mkdir()
    assert checkpoint.is_checkpoint(other)


def test_other_paths_are_not_checkpoints(tmp_path):
    weights = tmp_path / "model.weights.h5"
    weights.write_bytes(b"")
    assert not checkpoint.is_checkpoint(weights)
    assert not checkpoint.is_checkpoint(tmp_path / "missing")
    assert not checkpoint.is_checkpoint("gs://bucket/checkpoint")
    assert not checkpoint.is_checkpoint(None)
    assert checkpoint.complete_steps(tmp_path / "missing") == []
