"""`smoltrain run` end to end: bad input, resume, elastic leave/join, inventory launch."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest
from elastic import watch
from runtools import smoltrain

from smoltrain.cli import main
from smoltrain.schema import check_any

SMALL = ["--batch", "6", "--seq", "32"]


def one_line_error(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return rc, err


# --- bad input: one clear line, non-zero exit, nothing started ---
def test_unknown_strategy(capsys, secret_file):
    rc, err = one_line_error(capsys, ["run", "--strategy", "zero9", "--local", "2", "--secret-file", secret_file])
    assert rc == 2 and "unknown strategy 'zero9'" in err


@pytest.mark.parametrize("strategy,world,what", [("pp", 7, "layers"), ("tp", 7, "head"), ("mp", 7, "layers")])
def test_world_size_must_divide_the_model(capsys, secret_file, strategy, world, what):
    rc, err = one_line_error(
        capsys, ["run", "--strategy", strategy, "--local", str(world), "--secret-file", secret_file]
    )
    assert rc == 2 and what in err and ("divide" in err or "fewer than" in err)


def test_missing_data(capsys, tmp_path, secret_file):
    rc, err = one_line_error(
        capsys,
        ["run", "--strategy", "dp", "--local", "1", "--data", str(tmp_path / "none.txt"), "--secret-file", secret_file],
    )
    assert rc == 2 and "no such file" in err


def test_corrupt_checkpoint(capsys, tmp_path, secret_file):
    d = tmp_path / "ck" / "step-000003"
    d.mkdir(parents=True)
    meta = {"strategy": "dp", "model": "tiny", "seed": 0, "batch": 6, "seq": 32, "world_size": 1, "step": 3}
    (d / "complete.json").write_text(json.dumps(meta))
    (d / "rank0.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    rc, err = one_line_error(
        capsys,
        [
            "run",
            "--strategy",
            "dp",
            "--local",
            "1",
            *SMALL,
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--resume",
            "--secret-file",
            secret_file,
        ],
    )
    assert rc == 1 and "corrupt" in err and "rank0.safetensors" in err


def test_unreachable_host(capsys, tmp_path, secret_file):
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "cluster:\n  hosts:\n    ghost:\n      ansible_host: 127.0.0.1\n      ansible_port: 9\n"
        "      ansible_user: nobody\n      cluster_ip: 127.0.0.9\n"
    )
    rc, err = one_line_error(
        capsys,
        [
            "run",
            "--strategy",
            "dp",
            "-i",
            str(inv),
            *SMALL,
            "--steps",
            "1",
            "--secret-file",
            secret_file,
            "--out",
            str(tmp_path),
        ],
    )
    assert rc == 1 and "ghost" in err


# --- resume: 10 steps == 5 steps + resume 5 ---
def test_resume_continues_exactly(tmp_path, secret_file):
    full, half = tmp_path / "full", tmp_path / "half"
    common = ["--strategy", "fsdp", "--local", "2", *SMALL, "--secret-file", secret_file, "--out", str(tmp_path)]
    p = smoltrain(
        "run",
        *common,
        "--steps",
        "10",
        "--checkpoint-dir",
        str(full),
        "--checkpoint-every",
        "5",
        "--json",
        str(tmp_path / "a.json"),
    )
    assert p.returncode == 0, p.stderr + p.stdout
    # the 5-step checkpoint of that run is exactly what a 5-step run leaves behind
    shutil.copytree(full / "step-000005", half / "step-000005")
    p = smoltrain(
        "run", *common, "--steps", "10", "--checkpoint-dir", str(half), "--resume", "--json", str(tmp_path / "b.json")
    )
    assert p.returncode == 0, p.stderr + p.stdout
    a, b = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "b.json").read_text())
    assert [s["step"] for s in b["steps"]] == list(range(5, 10))
    for x, y in zip(a["steps"][5:], b["steps"]):
        assert abs(x["loss"] - y["loss"]) <= 1e-6 * abs(x["loss"])
    assert {"step": 5, "kind": "resume", "who": "all", "skipped": []} in b["events"]
    assert any(e["kind"] == "checkpoint" and e["step"] == 10 for e in b["events"])
    assert (half / "step-000010" / "complete.json").exists()


# --- edp: a worker is SIGKILLed mid-run and a newcomer joins; the run finishes ---
def test_edp_survives_sigkill_and_admits_a_newcomer(tmp_path, secret_file):
    report = tmp_path / "edp.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            "edp",
            "--local",
            "3",
            *SMALL,
            "--steps",
            "20",
            "--pace",
            "0.3",
            "--barrier-timeout",
            "20",
            "--secret-file",
            secret_file,
            "--json",
            str(report),
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    rc, out = watch(proc, secret_file, lambda line, seen: re.match(r"step 3/", line))
    assert rc == 0, out[-2000:]
    doc = check_any(json.loads(report.read_text()))
    kinds = {(e["kind"], e["who"]) for e in doc["events"]}
    assert ("leave", "rank2") in kinds, out[-2000:]
    assert ("join", "join1") in kinds, out[-2000:]
    assert [s["step"] for s in doc["steps"]] == list(range(20))
    assert doc["steps"][-1]["loss"] < doc["steps"][0]["loss"]
    assert any(b["src"] == "join1" and b["dst"] == "rank0" and b["bytes"] > 0 for b in doc["bytes"])


# --- the inventory path, with local hosts on loopback addresses ---
def test_inventory_launch_with_local_hosts(tmp_path, secret_file):
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "cluster:\n  hosts:\n"
        f"    alpha:\n      ansible_connection: local\n      cluster_ip: 127.0.0.2\n"
        f"      smol_python: {sys.executable}\n      smol_train_port: 0\n"
        f"    beta:\n      ansible_connection: local\n      cluster_ip: 127.0.0.3\n"
        f"      smol_python: {sys.executable}\n"
    )
    from smoltrain.comm.group import free_port_base

    text = inv.read_text().replace("smol_train_port: 0", f"smol_train_port: {free_port_base(2, '127.0.0.2')}")
    inv.write_text(text)
    # a measured links report of these hosts in reports/: run plans on it by itself
    (tmp_path / "reports").mkdir()
    link = {
        "status": "ok",
        "throughput_mbit": 123.0,
        "retransmits": 0,
        "mtu_effective": 1500,
        "mtu_configured": 1500,
        "ceiling_mbit": None,
        "method": "builtin",
        "warnings": [],
        "error": None,
        "rtt_us": {"min": 50.0, "p50": 60.0, "p90": 70.0, "p99": 80.0, "max": 90.0},
    }
    links = {
        "schema": "smolnet.links/1",
        "created": "2026-12-02T10:00:00Z",
        "settings": {"duration_s": 1.0, "backend": "builtin"},
        "hosts": [
            {
                "name": n,
                "address": a,
                "iface": "lo",
                "mtu_configured": 1500,
                "link_rate_mbit": None,
                "device": "generic",
                "status": "ok",
                "error": None,
            }
            for n, a in (("alpha", "127.0.0.2"), ("beta", "127.0.0.3"))
        ],
        "links": [dict(link, src="alpha", dst="beta"), dict(link, src="beta", dst="alpha")],
    }
    (tmp_path / "reports" / "links.json").write_text(json.dumps(links))
    p = smoltrain(
        "run",
        "--strategy",
        "tp",
        "-i",
        str(inv),
        *SMALL,
        "--steps",
        "3",
        "--secret-file",
        secret_file,
        "--json",
        str(tmp_path / "r.json"),
        "--out",
        str(tmp_path),
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr + p.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["hosts"] == ["alpha", "beta"] and doc["world_size"] == 2
    assert {(b["src"], b["dst"]) for b in doc["bytes"]} == {("alpha", "beta"), ("beta", "alpha")}
    assert {link["rate_mbit"] for link in doc["plan"]["links"]} == {123.0}


# --- syncps: a stalled worker (SIGSTOP) misses the barrier and is dropped, no hang ---
def test_syncps_drops_a_stalled_worker(tmp_path, secret_file):
    report = tmp_path / "ps.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            "syncps",
            "--local",
            "3",
            *SMALL,
            "--steps",
            "8",
            "--pace",
            "0.2",
            "--barrier-timeout",
            "2",
            "--secret-file",
            secret_file,
            "--json",
            str(report),
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, stopped = [], None
    timer = threading.Timer(180, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if stopped is None and re.match(r"step 2/", line):
                stopped = int(re.search(r"worker rank1 pid (\d+)", "".join(lines)).group(1))
                os.kill(stopped, signal.SIGSTOP)
        rc = proc.wait(timeout=30)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
        if stopped:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = "".join(lines)
    assert rc == 0, out[-2000:]
    doc = json.loads(report.read_text())
    assert [(e["kind"], e["who"]) for e in doc["events"] if e["kind"] == "leave"] == [("leave", "rank1")]
    assert "barrier timeout" in out
    assert [s["step"] for s in doc["steps"]] == list(range(8))


def test_print_torchrun(capsys, secret_file):
    assert (
        main(
            [
                "run",
                "--strategy",
                "tp",
                "--local",
                "2",
                "--backend",
                "torch",
                "--print-torchrun",
                "--secret-file",
                secret_file,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("torchrun ")]
    assert len(lines) == 2 and all("-m smoltrain worker --control" in ln for ln in lines)
    assert "--node-rank 1" in lines[1] and secret_file in lines[0]  # the secret travels on stdin, by file
    assert "--external" in out


# --- a planner fault does not stop the run, and does not pass in silence ---
def test_a_run_whose_plan_fails_records_plan_error(tmp_path, secret_file, monkeypatch, capsys):
    """A bug in the planner (here: it raises) used to leave the report without a plan and
    without a word; now the run says so and its report carries `plan_error`. The plan of a
    healthy run is always present (test_plan_local)."""
    from smoltrain.planner import request

    def broken(req, setting=None):
        raise ZeroDivisionError("a planner bug")

    monkeypatch.setattr(request, "build_plan", broken)
    out = tmp_path / "r.json"
    argv = ["run", "--strategy", "dp", "--local", "2", *SMALL, "--steps", "2", "--secret-file", secret_file]
    assert main(argv + ["--json", str(out), "--out", str(tmp_path)]) == 0
    doc = check_any(json.loads(out.read_text()))
    assert doc["status"] == "complete" and "plan" not in doc
    assert doc["plan_error"] == "ZeroDivisionError: a planner bug"
    assert "plan failed: ZeroDivisionError: a planner bug" in capsys.readouterr().out
