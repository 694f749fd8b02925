"""Issue 15, defects 2, 3, 4 and 7 end to end: stalls and partitions detected through
authenticated heartbeats, the right rank blamed, and the report written however the run ends."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

SMALL = ["--batch", "4", "--seq", "32"]


class Run:
    """`smoltrain run` in the background, its output read line by line."""

    def __init__(self, tmp_path, secret_file, *extra, world=2, strategy="dp"):
        self.report = tmp_path / "run.json"
        argv = [
            sys.executable,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            strategy,
            "--local",
            str(world),
            *SMALL,
            "--steps",
            "400",
            "--pace",
            "0.1",
            "--heartbeat",
            "0.4",
            "--secret-file",
            secret_file,
            "--json",
            str(self.report),
            "--out",
            str(tmp_path),
            *extra,
        ]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self.timer = threading.Timer(150, self.proc.kill)  # a hang fails the test, never the suite
        self.timer.start()
        self.stopped: list[int] = []

    def until(self, pattern: str) -> re.Match:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"never saw {pattern!r}: {''.join(self.lines)[-2000:]}")

    def pids(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"worker (\w+) pid (\d+)", "".join(self.lines))}

    def stop(self, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self.stopped.append(pid)

    def finish(self) -> tuple[int, str]:
        try:
            self.lines.extend(self.proc.stdout)
            rc = self.proc.wait(timeout=30)
        finally:
            self.timer.cancel()
            for pid in self.stopped:
                for sig in (signal.SIGKILL, signal.SIGCONT):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            if self.proc.poll() is None:
                self.proc.kill()
        return rc, "".join(self.lines)


def test_a_stopped_worker_is_named_and_the_report_says_failed(tmp_path, secret_file):
    run = Run(tmp_path, secret_file, world=3)
    run.until(r"step 3/")
    run.stop(run.pids()["rank1"])
    rc, out = run.finish()
    assert rc == 1, out[-2000:]
    assert "rank1: no heartbeat" in out, out[-2000:]
    doc = json.loads(run.report.read_text())
    assert doc["status"] == "failed" and doc["blamed"] == "rank1" and "heartbeat" in doc["error"]
    assert len(doc["steps"]) >= 2  # the steps that finished survive


def test_pokes_on_the_control_port_never_hide_a_stalled_cluster(tmp_path, secret_file):
    run = Run(tmp_path, secret_file, "--timeout", "300")
    port = int(run.until(r"control channel 127\.0\.0\.1:(\d+)").group(1))
    run.until(r"step 3/")
    for pid in run.pids().values():
        run.stop(pid)
    done = threading.Event()

    def poke():
        while not done.is_set():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                pass
            time.sleep(0.2)

    t = threading.Thread(target=poke, daemon=True)
    t.start()
    try:
        rc, out = run.finish()
    finally:
        done.set()
    assert rc == 1 and "no heartbeat" in out, out[-2000:]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] in "ZX"  # exited (a zombie: its parent is stopped)
    except FileNotFoundError:
        return True


def test_a_stopped_controller_is_blamed_as_the_controller(tmp_path, secret_file):
    run = Run(tmp_path, secret_file)
    run.until(r"step 3/")
    workers = list(run.pids().values())
    os.kill(run.proc.pid, signal.SIGSTOP)  # the controller is cut off: no RST, no FIN, just silence
    try:
        deadline = time.monotonic() + 60
        while not all(_gone(p) for p in workers):  # the workers give up on it by themselves
            assert time.monotonic() < deadline, "workers outlived a silent controller"
            time.sleep(0.1)
    finally:
        os.kill(run.proc.pid, signal.SIGCONT)
    rc, out = run.finish()
    assert rc == 1 and "error: controller: stopped itself for" in out, out[-2000:]
    doc = json.loads(run.report.read_text())
    assert doc["status"] == "failed" and doc["blamed"] == "controller", doc.get("error")


def test_ctrl_c_writes_an_interrupted_report_and_exits_130(tmp_path, secret_file):
    run = Run(tmp_path, secret_file)
    run.until(r"step 3/")
    run.proc.send_signal(signal.SIGINT)
    rc, out = run.finish()
    assert rc == 130, out[-2000:]
    doc = json.loads(run.report.read_text())
    assert doc["status"] == "interrupted" and len(doc["steps"]) >= 2


def test_a_diverging_loss_fails_the_run(tmp_path, secret_file):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            "dp",
            "--local",
            "1",
            *SMALL,
            "--steps",
            "8",
            "--lr",
            "1000",  # the largest --lr allowed; Adam at 1000 diverges within a few steps
            "--secret-file",
            secret_file,
            "--json",
            str(tmp_path / "r.json"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "loss is" in p.stderr, p.stderr + p.stdout[-1000:]
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "failed"
