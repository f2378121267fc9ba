"""`save_checkpoint`'s pointer: `checkpoints/latest` names a whole checkpoint whenever the
trainer dies, so `resume=true` never starts a run over."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollover.training.checkpoint import latest_checkpoint, save_checkpoint


class Files:
    """A Checkpointable that writes one small file per part."""

    def save(self, directory: str | Path) -> Path:
        Path(directory).mkdir(parents=True)
        (Path(directory) / "weights").write_text("w")
        return Path(directory)

    def save_training_state(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True)
        (Path(directory) / "shard").write_text("s")


def test_latest_names_each_new_checkpoint(tmp_path):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, Files(), {"global_step": step})
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / f"step_{step}"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]


def test_a_death_while_the_pointer_is_written_leaves_the_last_one(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, Files(), {"global_step": 1})
    write_text = Path.write_text

    def dies_after_truncating(path: Path, text: str, *args, **kwargs) -> int:
        if "latest" in path.name:  # the file is opened (emptied), then the process dies
            write_text(path, "")
            raise KeyboardInterrupt("killed")
        return write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", dies_after_truncating)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, Files(), {"global_step": 2})
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"
    # The next save (the resumed run's) replaces the stale pieces.
    save_checkpoint(tmp_path, 2, Files(), {"global_step": 2})
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_2"


def test_a_save_cut_short_leaves_nothing_in_the_next(tmp_path):
    """A kill while step 2 was being saved left its half-written folder (here: a shard of a run
    on more ranks); the resumed run's save of step 2 starts from an empty one."""
    save_checkpoint(tmp_path, 1, Files(), {"global_step": 1})
    stale = tmp_path / "checkpoints" / ".step_2.partial" / "training_state"
    stale.mkdir(parents=True)
    (stale / "__1_0.distcp").write_text("a shard of the dead run")
    saved = save_checkpoint(tmp_path, 2, Files(), {"global_step": 2})
    assert sorted(p.name for p in (saved / "training_state").iterdir()) == ["shard"]
    assert not (tmp_path / "checkpoints" / ".step_2.partial").exists()
