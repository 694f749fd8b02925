"""Issue 15, defects 4 and 6 (units): blame from every rank's view; checkpoints that carry their
run's identity, fall back past damage, are fsynced, leave no temp files and are pruned."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from smolnet.errors import SmolError
from smoltrain.models.spec import get_model
from smoltrain.run import blame, checkpoint
from smoltrain.run.config import RunConfig


def _cfg(**kw) -> RunConfig:
    base = dict(
        strategy="dp",
        backend="socket",
        model=get_model("tiny"),
        steps=10,
        batch=4,
        seq=32,
        lr=1e-3,
        seed=0,
        names=("rank0", "rank1"),
        devices=("cpu", "cpu"),
        data_digest="abc",
    )
    base.update(kw)
    return RunConfig(**base)


def _save(root, step, cfg, value=1.0, parts=("rank0", "rank1")):
    for p in parts:
        checkpoint.save_part(root, step, p, {"w": torch.full((4,), value)})
    checkpoint.mark_complete(root, step, checkpoint.identity(cfg))


def test_another_runs_checkpoint_is_refused(tmp_path):
    _save(tmp_path, 4, _cfg(lr=2e-3))  # a newer step of an older run with another learning rate
    with pytest.raises(SmolError, match=r"another run.*lr=0\.002"):
        checkpoint.latest(tmp_path, checkpoint.identity(_cfg()), ["rank0", "rank1"])
    assert checkpoint.latest(tmp_path, checkpoint.identity(_cfg(lr=2e-3)), ["rank0", "rank1"]) == 4


def test_another_corpus_is_another_run(tmp_path):
    _save(tmp_path, 4, _cfg(data_digest="other"))
    with pytest.raises(SmolError, match="another run"):
        checkpoint.latest(tmp_path, checkpoint.identity(_cfg()), ["rank0"])


def test_a_damaged_newest_checkpoint_falls_back_to_the_last_complete_one(tmp_path):
    cfg = _cfg()
    _save(tmp_path, 3, cfg)
    _save(tmp_path, 6, cfg)
    part = checkpoint.step_dir(tmp_path, 6) / "rank1.safetensors"
    part.write_bytes(part.read_bytes()[:20])  # torn write
    assert checkpoint.latest(tmp_path, checkpoint.identity(cfg), ["rank0", "rank1"]) == 3
    (checkpoint.step_dir(tmp_path, 3) / "complete.json").write_text("{not json")
    with pytest.raises(SmolError, match="corrupt"):
        checkpoint.latest(tmp_path, checkpoint.identity(cfg), ["rank0", "rank1"])


def test_temp_files_are_removed_and_only_the_newest_are_kept(tmp_path):
    cfg = _cfg()
    for step in range(1, 6):
        _save(tmp_path, step, cfg)
    stray = checkpoint.step_dir(tmp_path, 5) / "rank0.safetensors.tmp999"
    stray.write_bytes(b"half")
    assert checkpoint.prune(tmp_path, 3) == [1, 2]
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["step-000003", "step-000004", "step-000005"]
    assert checkpoint.latest(tmp_path, checkpoint.identity(cfg), ["rank0", "rank1"]) == 5
    assert not stray.exists()


def test_parts_marker_and_folder_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    _save(tmp_path, 2, _cfg(), parts=("rank0",))
    d = str(checkpoint.step_dir(tmp_path, 2))
    assert any(s.startswith(d + "/rank0.safetensors") for s in synced), synced
    assert any(s.startswith(d + "/complete.json") for s in synced), synced
    assert d in synced, synced


def test_blame_the_cut_host_not_the_first_error_to_arrive():
    v = blame.Views(["rank0", "rank1", "rank2", "rank3"])
    # the cut host's own error arrives first and names a healthy neighbour
    v.error("rank2", "CommError: rank 1 (10.0.0.2:7001) timed out", "rank1")
    v.error("rank1", "CommError: rank 2 (10.0.0.3:7002) timed out", "rank2")
    v.error("rank3", "CommError: rank 2 (10.0.0.3:7002) closed", "rank2")
    who, why = blame.culprit(v)
    assert who == "rank2" and "rank1, rank3" in why


def test_blame_prefers_silence_and_death_over_accusations():
    v = blame.Views(["rank0", "rank1", "rank2"])
    v.error("rank0", "CommError: rank 1 timed out", "rank1")
    v.silent["rank2"] = 4.2
    assert blame.culprit(v)[0] == "rank2"
    v.died["rank1"] = "Killed"
    assert blame.culprit(v)[0] == "rank1"


def test_controller_waits_for_every_view_before_blaming(tmp_path):
    from smolnet.errors import SmolError
    from smoltrain.run.controller import Controller, Placement

    class Quiet:
        is_terminal = False

        def print(self, *a, **k):
            pass

        log = print

    names = ["rank0", "rank1", "rank2", "rank3"]
    ctl = Controller(
        _cfg(names=tuple(names), devices=("cpu",) * 4),
        [Placement(n, "127.0.0.1") for n in names],
        b"s" * 32,
        Quiet(),
        str(tmp_path),
    )
    for n in names:
        ctl.handle(n, {"type": "connected", "hello": {}}, None)
    ctl.handle("rank2", {"type": "error", "message": "CommError: rank 1 timed out", "peer": "rank1"}, None)
    ctl.handle("rank1", {"type": "error", "message": "CommError: rank 2 timed out", "peer": "rank2"}, None)
    ctl.handle("rank3", {"type": "error", "message": "CommError: rank 2 closed", "peer": "rank2"}, None)
    with pytest.raises(SmolError, match="^rank2: lost by rank1, rank3"):
        ctl.handle("rank0", {"type": "error", "message": "CommError: rank 3 closed", "peer": "rank3"}, None)
