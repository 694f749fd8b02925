"""Issue 15, defects 4 and 6, and issue 27 (units): blame from every rank's view (a stopped
controller blamed as the controller); checkpoints that carry their run's identity and a sha256
per part, fall back past damage (a flipped bit, a torn or missing part, an empty marker) saying
why, are fsynced, leave no temp files and are pruned."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smolnet.errors import SmolError
from smoltrain.cli import main
from smoltrain.models.spec import get_model
from smoltrain.run import blame, checkpoint
from smoltrain.run.config import RunConfig
from smoltrain.schema import check_any


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


def _save(root, step, cfg, value=1.0, parts=("rank0", "rank1"), n=4):
    digests = {p: checkpoint.save_part(root, step, p, {"w": torch.full((n,), value)}) for p in parts}
    checkpoint.mark_complete(root, step, checkpoint.identity(cfg), digests)


def test_another_runs_checkpoint_is_refused(tmp_path):
    _save(tmp_path, 4, _cfg(lr=2e-3))  # a newer step of an older run with another learning rate
    with pytest.raises(SmolError, match=r"another run.*lr=0\.002"):
        checkpoint.latest(tmp_path, checkpoint.identity(_cfg()), ["rank0", "rank1"])
    assert checkpoint.latest(tmp_path, checkpoint.identity(_cfg(lr=2e-3)), ["rank0", "rank1"]).step == 4


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
    assert checkpoint.latest(tmp_path, checkpoint.identity(cfg), ["rank0", "rank1"]).step == 3
    (checkpoint.step_dir(tmp_path, 3) / "complete.json").write_text("{not json")
    with pytest.raises(SmolError, match="no intact checkpoint.*truncated.*not valid JSON"):
        checkpoint.latest(tmp_path, checkpoint.identity(cfg), ["rank0", "rank1"])


def _flip(path, n=4096):
    """XOR n bytes in the middle of a file: same size, different content (a bad sector, a bad copy)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid - n // 2 : mid + n // 2] = bytes(b ^ 0xFF for b in data[mid - n // 2 : mid + n // 2])
    path.write_bytes(bytes(data))


def _damage(kind: str, d: Path) -> str:
    part, marker = d / "rank1.safetensors", d / "complete.json"
    if kind == "bit flip":
        size = part.stat().st_size
        _flip(part)
        assert part.stat().st_size == size
        return "rank1.safetensors is damaged: its sha256 differs"
    if kind == "truncated":
        part.write_bytes(part.read_bytes()[:-100])
        return "rank1.safetensors is truncated"
    if kind == "missing part":
        part.unlink()
        return "rank1.safetensors is missing"
    marker.write_text("")
    return "complete.json is empty"


@pytest.mark.parametrize("kind", ["bit flip", "truncated", "missing part", "empty complete.json"])
def test_a_damaged_newest_checkpoint_is_skipped_saying_why(tmp_path, kind):
    cfg = _cfg()
    _save(tmp_path, 3, cfg, value=3.0, n=4096)  # 16 KiB parts: a 4 KiB flip fits inside the tensor
    _save(tmp_path, 6, cfg, value=6.0, n=4096)
    why = _damage(kind, checkpoint.step_dir(tmp_path, 6))
    found = checkpoint.latest(tmp_path, checkpoint.identity(cfg), ["rank0", "rank1"])
    assert found.step == 3 and [s["step"] for s in found.skipped] == [6], found
    assert found.skipped[0]["why"].startswith(why), found.skipped
    line = found.skipped_line()
    assert "\n" not in line and "step-000006" in line and why in line and "from step 3" in line
    # what it resumes from is what was saved, and each rank checks its part again as it loads it
    got = checkpoint.load_part(tmp_path, 3, "rank1", found.sha256["rank1"])
    assert torch.equal(got["w"], torch.full((4096,), 3.0))
    # nothing intact: refused, naming every checkpoint and why
    _damage(kind, checkpoint.step_dir(tmp_path, 3))
    with pytest.raises(SmolError, match=r"no intact checkpoint.*step-000006: .*step-000003: "):
        checkpoint.latest(tmp_path, checkpoint.identity(cfg), ["rank0", "rank1"])


def test_a_rank_refuses_a_part_that_changed_after_verification(tmp_path):
    cfg = _cfg()
    _save(tmp_path, 2, cfg, n=4096)
    found = checkpoint.latest(tmp_path, checkpoint.identity(cfg), ["rank0", "rank1"])
    _flip(checkpoint.part_path(tmp_path, 2, "rank0"), 64)
    with pytest.raises(SmolError, match="rank0.safetensors: damaged"):
        checkpoint.load_part(tmp_path, 2, "rank0", found.sha256["rank0"])


def test_a_part_on_another_host_is_left_to_its_rank(tmp_path):
    cfg = _cfg()
    _save(tmp_path, 2, cfg)
    (checkpoint.step_dir(tmp_path, 2) / "rank1.safetensors").unlink()  # it lives on rank1's host
    found = checkpoint.latest(tmp_path, checkpoint.identity(cfg), ["rank0", "rank1"], all_here=False)
    assert found.step == 2 and set(found.sha256) == {"rank0", "rank1"}


def test_temp_files_are_removed_and_only_the_newest_are_kept(tmp_path):
    cfg = _cfg()
    for step in range(1, 6):
        _save(tmp_path, step, cfg)
    stray = checkpoint.step_dir(tmp_path, 5) / "rank0.safetensors.tmp999"
    stray.write_bytes(b"half")
    assert checkpoint.prune(tmp_path, 3) == [1, 2]
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["step-000003", "step-000004", "step-000005"]
    assert checkpoint.latest(tmp_path, checkpoint.identity(cfg), ["rank0", "rank1"]).step == 5
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


def test_a_stopped_controller_blames_itself_not_the_ranks_that_gave_up_on_it():
    v = blame.Views(["rank0", "rank1"])
    v.silent.update({"rank0": 21.0, "rank1": 21.0})  # silent because we were not listening
    v.died["rank0"] = "no heartbeat from the controller for 5s (cut off or stopped); exiting"
    assert blame.culprit(v)[0] == "rank0"
    v.stalled = 20.4
    who, why = blame.culprit(v)
    assert who == "controller" and "20.4s" in why and "SIGSTOP" in why


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


# --- end to end: `smoltrain run --resume` past a flipped bit; refused (with a report) when nothing is intact ---
def _run(*args, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "smoltrain", "run", *args], capture_output=True, text=True, timeout=timeout
    )


def test_resume_skips_a_damaged_checkpoint_and_the_report_says_so(tmp_path, capsys):
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    common = ["--strategy", "dp", "--local", "1", "--batch", "2", "--seq", "16", "--secret-file", str(secret)]
    common += ["--out", str(tmp_path)]
    ck, dead = tmp_path / "ck", tmp_path / "dead"
    p = _run(
        *common,
        "--steps",
        "4",
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "2",
        "--json",
        str(tmp_path / "a.json"),
    )
    assert p.returncode == 0, p.stderr + p.stdout
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["status"] == "complete" and a["error"] is None  # a run that succeeds says so
    shutil.copytree(ck, dead)
    _flip(ck / "step-000004" / "rank0.safetensors")

    # nothing intact: one line, exit 1, and a `failed` report with no steps, before any worker starts
    _flip(dead / "step-000004" / "rank0.safetensors")
    (dead / "step-000002" / "complete.json").write_text("")
    report = tmp_path / "dead.json"
    rc = main(["run", *common, "--steps", "6", "--checkpoint-dir", str(dead), "--resume", "--json", str(report)])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0, err
    assert "no intact checkpoint" in err and "step-000004: rank0.safetensors is damaged" in err, err
    assert "step-000002: complete.json is empty" in err, err
    doc = json.loads(report.read_text())
    check_any(doc)
    assert doc["status"] == "failed" and doc["steps"] == [] and "no intact checkpoint" in doc["error"], doc

    # the newest is damaged: resume from step 2, say so in one line and in the report
    p = _run(*common, "--steps", "6", "--checkpoint-dir", str(ck), "--resume", "--json", str(tmp_path / "b.json"))
    assert p.returncode == 0, p.stderr + p.stdout
    lines = [x for x in p.stdout.splitlines() if "skipped" in x]
    assert len(lines) == 1 and "step-000004 (rank0.safetensors is damaged: its sha256" in lines[0], p.stdout
    b = json.loads((tmp_path / "b.json").read_text())
    check_any(b)
    resume = [e for e in b["events"] if e["kind"] == "resume"]
    assert resume == [
        {"step": 2, "kind": "resume", "who": "all", "skipped": [{"step": 4, "why": resume[0]["skipped"][0]["why"]}]}
    ]
    assert "sha256" in resume[0]["skipped"][0]["why"]
    # steps 2 and 3 again, from the intact step-2 weights: the same losses as the first run
    assert [s["step"] for s in b["steps"]] == [2, 3, 4, 5]
    for x, y in zip(a["steps"][2:4], b["steps"][:2]):
        assert abs(x["loss"] - y["loss"]) <= 1e-6 * abs(x["loss"]), (x, y)


def test_a_run_refused_before_any_worker_starts_still_writes_its_report(tmp_path, capsys):
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    _save(tmp_path / "ck", 4, _cfg(lr=2e-3))  # another run's checkpoint in the folder
    report = tmp_path / "r.json"
    argv = ["run", "--strategy", "dp", "--local", "2", "--batch", "4", "--seq", "32", "--steps", "8"]
    argv += ["--checkpoint-dir", str(tmp_path / "ck"), "--resume", "--json", str(report)]
    rc = main([*argv, "--secret-file", str(secret), "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0 and "belongs to another run" in err, err
    doc = json.loads(report.read_text())
    check_any(doc)
    assert doc["status"] == "failed" and "belongs to another run" in doc["error"]
    assert doc["steps"] == [] and doc["world_size"] == 2 and doc["hosts"] == ["rank0", "rank1"]
