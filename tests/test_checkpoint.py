"""megatron_opd/trainer/checkpoint.py: re-saving a step never leaves `latest` dangling, loads fall back
to a complete checkpoint, pruning orders by step number and never removes what `latest` names."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from megatron_opd.trainer import checkpoint as ck
from megatron_opd.trainer.checkpoint import CheckpointManager

pytestmark = pytest.mark.megatron  # version-sensitive: CI's py3.12 + megatron-core 0.19 leg runs it


def _state(v: float) -> dict:
    return {"w": torch.full((2,), v), "step_tag": v}


def _value(mgr: CheckpointManager, step=None) -> float:
    return float(mgr.load(step)[1]["w"][0])


def test_resave_replaces_the_step_and_keeps_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, _state(1.0))
    mgr.save(2, _state(2.0))
    mgr.save(1, _state(10.0))  # e.g. a rollback re-saving step 1 with new state
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert mgr.latest_step() == 1 and _value(mgr) == 10.0
    assert mgr.steps() == [1]  # step 2 lies beyond `latest`: abandoned, never resumed, pruned
    assert not list(tmp_path.glob(".old_step_*")) and not list(tmp_path.glob(".tmp_step_*"))


class _Killed(BaseException):
    pass


@pytest.mark.parametrize("phase", ["written", "moved_aside", "renamed"])
def test_kill_during_resave_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, phase, caplog):
    """A kill at each point of a re-save of step 1 (simulated by raising out of the test hook) leaves
    `latest` resolvable to a complete copy of step 1: the old one before the new is in place, else the new."""
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, _state(1.0))

    def die(p, step):
        if p == phase:
            raise _Killed

    monkeypatch.setattr(ck, "_pause_for_test", die)
    with pytest.raises(_Killed):
        mgr.save(1, _state(10.0))
    monkeypatch.undo()
    fresh = CheckpointManager(tmp_path, keep_last=3)
    with caplog.at_level(logging.WARNING, logger="megatron_opd.checkpoint"):
        assert fresh.latest_step() == 1
    assert fresh.steps() == [1]
    assert _value(fresh) == (10.0 if phase == "renamed" else 1.0)
    # the next save cleans up whatever the kill left behind
    fresh.save(2, _state(2.0))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "latest") == ["step_00000001", "step_00000002"]


def test_dangling_pointer_falls_back_to_newest_complete_with_warning(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    for s in (1, 2, 3):
        mgr.save(s, _state(float(s)))
    shutil.rmtree(tmp_path / "step_00000003")
    (tmp_path / "step_00000002" / "rank0.pt").unlink()  # damaged: meta present, rank file gone
    with caplog.at_level(logging.WARNING, logger="megatron_opd.checkpoint"):
        assert mgr.latest_step() == 1
    assert "step_00000003" in caplog.text and "step 1" in caplog.text
    assert _value(mgr) == 1.0
    (tmp_path / "latest").unlink()  # no pointer at all (killed before the first pointer write)
    assert mgr.latest_step() == 1
    shutil.rmtree(tmp_path / "step_00000001")
    (tmp_path / "latest").write_text("step_00000001\n")
    assert mgr.latest_step() is None  # nothing complete: start fresh rather than crash
    with pytest.raises(FileNotFoundError):
        mgr.load()


def test_pruning_orders_by_step_number_and_ignores_foreign_names(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    (tmp_path / "step_foo").mkdir(parents=True)
    (tmp_path / "step_foo" / "keep.txt").write_text("not ours")
    for s in (99_999_998, 99_999_999, 100_000_000):
        mgr.save(s, _state(float(s % 7)))
    names = sorted(p.name for p in tmp_path.iterdir())
    # by name, "step_100000000" < "step_99999999": a name sort would have deleted the newest one
    assert names == ["latest", "step_100000000", "step_99999999", "step_foo"]
    assert mgr.steps() == [99_999_999, 100_000_000] and mgr.latest_step() == 100_000_000


def test_pruning_never_removes_the_latest_step(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(5, _state(5.0))
    # a newer checkpoint left over (e.g. an abandoned trajectory); re-save step 2 and point latest at it
    mgr.save(2, _state(2.0))
    assert mgr.latest_step() == 2 and _value(mgr) == 2.0
    assert mgr.steps() == [2]  # the abandoned step 5 is gone, the pointed-at step 2 kept


def test_rollback_save_keeps_older_checkpoints_and_drops_abandoned_ones(tmp_path):
    """keep_last counts only checkpoints a resume can reach: re-saving step 6 out of {4, 6, 8, 10} (a
    rollback) keeps 4 and 6 and drops 8 and 10; counting the abandoned ones would have deleted 4."""
    mgr = CheckpointManager(tmp_path, keep_last=4)
    for s in (4, 6, 8, 10):
        mgr.save(s, _state(float(s)))
    mgr.keep_last = 2
    mgr.save(6, _state(6.5))
    assert mgr.latest_step() == 6 and _value(mgr) == 6.5
    assert mgr.steps() == [4, 6]


def test_per_rank_format_with_its_layout_recorded_is_refused_at_another_layout_of_the_same_world_size(tmp_path):
    """Regression: a format-1 checkpoint (per-rank student shards) that recorded tp=2 was loaded at dp=2 (same
    world size) and torch then failed on the shards ("size mismatch"); now the project's refusal, with what to
    do. At its own layout it still loads each rank's own file."""
    import json

    d = tmp_path / "step_00000001"
    d.mkdir()
    for r in (0, 1):
        torch.save({"r": r}, d / f"rank{r}.pt")
    (d / "meta.json").write_text(json.dumps({"step": 1, "world_size": 2, "tp": 2, "pp": 1, "dp": 1}))
    (tmp_path / "latest").write_text("step_00000001\n")
    own = CheckpointManager(tmp_path, rank=1, world_size=2, layout={"tp": 2, "pp": 1, "dp": 1})
    assert own.load(1)[1]["r"] == 1
    for layout in ({"tp": 1, "pp": 1, "dp": 2}, {"tp": 1, "pp": 2, "dp": 1}):
        other = CheckpointManager(tmp_path, rank=1, world_size=2, layout=layout)
        with pytest.raises(RuntimeError, match=r"per-rank format .* written at world_size=2, tp=2, pp=1, dp=1; it "
                                               r"resumes only there \(this run is at world_size=2, tp=1, .*\)\. "
                                               r"Resume it once at its own layout"):
            other.load(1)


def test_pause_hook_only_fires_for_its_phase_and_step(tmp_path, monkeypatch):
    monkeypatch.setenv(ck.PAUSE_ENV, "moved_aside:7")  # another step: the re-save of step 1 does not pause
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _state(1.0))
    mgr.save(1, _state(1.5))
    assert _value(mgr) == 1.5


def test_rank_files_at_the_writing_layout_and_rank0s_at_another(tmp_path):
    """Each rank reads its own file where the layout is the writer's (a format-1 checkpoint records only its
    world size), rank 0's at another layout (format 2: the shared part carries the student)."""
    import json

    d = tmp_path / "step_00000001"
    d.mkdir()
    for r in (0, 1):
        torch.save({"r": r}, d / f"rank{r}.pt")
    (d / "meta.json").write_text(json.dumps({"step": 1, "world_size": 2}))
    (tmp_path / "latest").write_text("step_00000001\n")
    legacy = CheckpointManager(tmp_path, rank=1, world_size=2, layout={"tp": 2, "pp": 1, "dp": 1})
    step, state, shared = legacy.load(1)
    assert (step, state["r"], shared) == (1, 1, None)
    (d / "shared").mkdir()
    (d / "shared" / "metadata.json").write_text("{}")
    (d / "meta.json").write_text(json.dumps({"step": 1, "world_size": 2, "tp": 2, "pp": 1, "dp": 1, "format": 2}))
    assert legacy.load(1)[1]["r"] == 1
    swapped = CheckpointManager(tmp_path, rank=1, world_size=2, layout={"tp": 1, "pp": 1, "dp": 2})
    _, state, shared = swapped.load(1)
    assert state["r"] == 0 and shared == d / "shared"
