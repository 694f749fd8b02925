"""Fault matrix: every trainable strategy under every fault, on loopback (`--local`).

For each strategy (dp, fsdp, syncps, edp, mp, pp, tp) and fault:
  sigkill     worker rank1 SIGKILLed mid-run
  sigstop     worker rank1 SIGSTOPped mid-run (a stall: only heartbeats can tell)
  controller  the controller SIGKILLed mid-run (workers must notice and exit)
  ctlstop     the controller SIGSTOPped mid-run (cut off without a reset: only heartbeats tell),
              then continued once its workers gave up: it must blame itself, not rank 0
  flood       silent TCP connections held on every listening port of the run, from its start
              (rendezvous, rank mesh, control channel, parameter server: 64 each, 200 mid-run)
it records the detection time (fault -> controller exit, or -> the `leave` event for the
elastic strategies, or -> the last worker gone when the controller dies), whom the controller
blamed, the exit status, whether the report and the newest complete checkpoint survived, and
during a flood whether a legitimate client (one that knows the secret) still got through.

Checkpoint faults (`--checkpoints`): each strategy trains 4 steps with a checkpoint every 2,
then the newest checkpoint (step 4) is damaged and the run resumed to step 6:
  ck-bitflip  4 KiB XORed in the middle of a part (same size)
  ck-truncate a part cut short by 100 bytes
  ck-missing  a part deleted
  ck-marker   complete.json emptied
  ck-none     step 4 flipped and step 2's complete.json emptied: nothing intact
it records what `--resume` said it skipped and why, how long the verification took
(checkpoint.latest on that folder, in-process), the step it resumed from, the exit status,
the report's status, and whether the resumed steps repeat the first run's losses (they
should: it resumed from the intact step-2 weights).

    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_faults.py --json bench/out/faults.json
    flock /tmp/smol-bench.lock .venv/bin/python bench/bench_faults.py --checkpoints --json bench/out/faults-ck.json
    .venv/bin/python bench/bench_faults.py --integrity   # cost of --integrity full vs header

A host link cut needs the sim (network namespaces); it is not part of this loopback matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import exit_code, write_result
from faults_bars import BAR, CK_BAR, cell_ok, ck_ok

STRATEGIES = ["dp", "fsdp", "syncps", "edp", "mp", "pp", "tp"]
FAULTS = ["sigkill", "sigstop", "controller", "ctlstop", "flood"]
CK_FAULTS = ["ck-bitflip", "ck-truncate", "ck-missing", "ck-marker", "ck-none"]
ELASTIC = {"syncps", "edp"}
HEARTBEAT = 0.5


def _listening_ports(pids: list[int]) -> list[int]:
    """TCP ports the run's processes listen on (control channel, parameter server, ...)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    ports = []
    for line in out.splitlines():
        if any(f"pid={p}," in line for p in pids):
            ports.append(int(line.split()[3].rsplit(":", 1)[1]))
    return sorted(set(ports))


def _session_ports(sid: int) -> set[int]:
    """Ports listened on by any process of the run's session (the controller leads it)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    ports = set()
    for line in out.splitlines():
        for pid in re.findall(r"pid=(\d+),", line):
            try:
                if os.getsid(int(pid)) == sid:
                    ports.add(int(line.split()[3].rsplit(":", 1)[1]))
            except OSError:
                pass
    return ports


class StartFlood:
    """Until stopped: every listening port the run opens gets `per_port` silent connections."""

    def __init__(self, sid: int, per_port: int = 64):
        self.sid, self.per_port, self.socks, self.ports = sid, per_port, [], set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for port in _session_ports(self.sid) - self.ports:
                self.ports.add(port)
                for _ in range(self.per_port):
                    try:
                        self.socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                    except OSError:
                        break
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in self.socks:
            s.close()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] in "ZX"
    except FileNotFoundError:
        return True


def _checkpoint_ok(ck: str) -> bool:
    from smoltrain.run import checkpoint

    done = checkpoint._complete_steps(__import__("pathlib").Path(ck))
    if not done:
        return False
    step, d = done[0]
    try:
        for p in d.glob("*.safetensors"):
            checkpoint.load_part(ck, step, p.stem)
    except Exception:
        return False
    return True


def _legit_client(port: int, secret: bytes) -> bool:
    from smolnet import wire

    try:
        s = wire.connect("127.0.0.1", port, secret, timeout=10.0, what="bench client")
        s.close()
        return True
    except Exception:
        return False


def _run_argv(strategy: str, world: int, secret_file: str, tmp: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "smoltrain",
        "run",
        "--strategy",
        strategy,
        "--local",
        str(world),
        "--batch",
        "4",
        "--seq",
        "32",
        "--secret-file",
        secret_file,
        "--out",
        tmp,
        *extra,
    ]


def cell(strategy: str, fault: str, secret_file: str, secret: bytes, tmp: str) -> dict:
    world = 3 if strategy in ELASTIC else 2
    report, ck = os.path.join(tmp, "run.json"), os.path.join(tmp, "ck")
    argv = _run_argv(
        strategy, world, secret_file, tmp, "--steps", "40", "--pace", "0.15", "--heartbeat", str(HEARTBEAT)
    )
    argv += ["--barrier-timeout", "3", "--timeout", "60", "--json", report]
    argv += ["--checkpoint-dir", ck, "--checkpoint-every", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    killer = threading.Timer(180, proc.kill)
    killer.start()
    row = {"strategy": strategy, "fault": fault, "world": world}
    flood: list[socket.socket] = []
    stopped = None
    start_flood = StartFlood(proc.pid) if fault == "flood" else None
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"step 6/", line):
                break
        pids = {m.group(1): int(m.group(2)) for m in re.finditer(r"worker (\w+) pid (\d+)", "".join(lines))}
        t0 = time.monotonic()
        if fault == "sigkill":
            os.kill(pids["rank1"], signal.SIGKILL)
        elif fault == "sigstop":
            stopped = pids["rank1"]
            os.kill(stopped, signal.SIGSTOP)
        elif fault == "controller":
            os.kill(proc.pid, signal.SIGKILL)
        elif fault == "ctlstop":
            os.kill(proc.pid, signal.SIGSTOP)
        elif fault == "flood":
            ports = _listening_ports([proc.pid, *pids.values()])
            for port in ports:
                for _ in range(200 // len(ports) + 1):
                    try:
                        flood.append(socket.create_connection(("127.0.0.1", port), timeout=2))
                    except OSError:
                        pass
            row["flood_ports"] = len(set(ports) | start_flood.ports)
            row["flood_conns"] = len(flood) + len(start_flood.socks)
            row["legit_served"] = all(_legit_client(p, secret) for p in ports)
        detected = None
        if fault in ("controller", "ctlstop"):
            while not all(_gone(p) for p in pids.values()) and time.monotonic() - t0 < 60:
                time.sleep(0.05)
            detected = time.monotonic() - t0
            if fault == "ctlstop":
                os.kill(proc.pid, signal.SIGCONT)  # it must now blame itself, not a rank
        for line in proc.stdout:
            lines.append(line)
            if detected is None and strategy in ELASTIC and re.search(r"event: leave", line):
                detected = time.monotonic() - t0
        rc = proc.wait(timeout=60)
        if detected is None and fault in ("sigkill", "sigstop"):
            detected = time.monotonic() - t0
        row["detect_s"] = round(detected, 2) if detected is not None else None
        row["rc"] = rc
    finally:
        killer.cancel()
        if start_flood is not None:
            start_flood.close()
        for s in flood:
            s.close()
        if stopped:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(stopped, sig)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a killed controller
        except (ProcessLookupError, PermissionError):
            pass
    out = "".join(lines)
    m = re.search(r"smoltrain: error: (\w+):", out)
    left = re.search(r"event: leave (\w+)", out)
    row["blamed"] = m.group(1) if m else (left.group(1) if left else None)
    try:
        doc = json.loads(Path(report).read_text())
        row["report"] = doc.get("status")
    except (OSError, ValueError):
        row["report"] = None
    row["checkpoint"] = _checkpoint_ok(ck)
    if fault in ("sigkill", "sigstop"):
        row["right_culprit"] = row["blamed"] == "rank1"
    return row


def _damage(kind: str, d: Path) -> None:
    part = sorted(d.glob("*.safetensors"))[-1]  # rank1 (or the parameter server's part)
    if kind in ("ck-bitflip", "ck-none"):
        data = bytearray(part.read_bytes())
        mid = len(data) // 2
        data[mid - 2048 : mid + 2048] = bytes(b ^ 0xFF for b in data[mid - 2048 : mid + 2048])
        part.write_bytes(bytes(data))
    elif kind == "ck-truncate":
        part.write_bytes(part.read_bytes()[:-100])
    elif kind == "ck-missing":
        part.unlink()
    elif kind == "ck-marker":
        (d / "complete.json").write_text("")


def checkpoint_cells(strategy: str, secret_file: str, tmp: str) -> list[dict]:
    """Train 4 steps (checkpoints at 2 and 4), damage step 4 each way, resume to step 6."""
    import shutil

    from smoltrain.run import checkpoint

    world = 3 if strategy in ELASTIC else 2
    base, first = os.path.join(tmp, "ck"), os.path.join(tmp, "first.json")
    p = subprocess.run(
        _run_argv(
            strategy, world, secret_file, tmp, "--steps", "4", "--checkpoint-dir", base, "--checkpoint-every", "2"
        )
        + ["--json", first],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0:
        return [{"strategy": strategy, "fault": "ck-setup", "error": (p.stderr or p.stdout)[-300:]}]
    losses = {s["step"]: s["loss"] for s in json.loads(Path(first).read_text())["steps"]}
    rows = []
    for kind in CK_FAULTS:
        ck = os.path.join(tmp, kind)
        shutil.copytree(base, ck)
        _damage(kind, Path(ck) / "step-000004")
        if kind == "ck-none":
            (Path(ck) / "step-000002" / "complete.json").write_text("")
        t = time.perf_counter()
        try:
            found = checkpoint.latest(ck, None, tidy=False)
            verified = {"resumed_from": found.step, "skipped": found.skipped}
        except Exception as e:
            verified = {"resumed_from": None, "skipped": str(e)}
        verify_s = time.perf_counter() - t
        report = os.path.join(tmp, f"{kind}.json")
        argv = _run_argv(strategy, world, secret_file, tmp, "--steps", "6", "--checkpoint-dir", ck, "--resume")
        p = subprocess.run(argv + ["--json", report], capture_output=True, text=True, timeout=300)
        out = p.stdout + p.stderr
        said = re.search(r"(resume: skipped .*|error: .*)", out)
        row = {"strategy": strategy, "fault": kind, "world": world, "rc": p.returncode, "verify_s": round(verify_s, 4)}
        row["said"] = said.group(1).strip() if said else None
        try:
            doc = json.loads(Path(report).read_text())
            row["report"] = doc.get("status")
            res = [e for e in doc.get("events", []) if e["kind"] == "resume"]
            row["resumed_from"] = res[0]["step"] if res else None
            row["skipped"] = res[0].get("skipped") if res else verified["skipped"]
            again = [s for s in doc.get("steps", []) if s["step"] in losses]
            row["losses_match"] = bool(again) and all(
                abs(s["loss"] - losses[s["step"]]) <= 1e-5 * abs(losses[s["step"]]) for s in again
            )
        except (OSError, ValueError) as e:
            row["report"] = f"unreadable: {e}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def integrity_cost(rounds: int) -> list[dict]:
    """all_reduce time with header MACs vs full-payload MACs (2 ranks, threads, loopback)."""
    import torch

    from smoltrain.comm import make_comm
    from smoltrain.comm.group import free_port_base

    secret = secrets.token_hex(16).encode()
    out = []
    for nbytes in (1 << 16, 1 << 20, 16 << 20):
        res = {}
        for integrity in ("header", "full"):
            port, got = free_port_base(2), {}

            def go(r, port=port, integrity=integrity, nbytes=nbytes, got=got):
                c = make_comm("socket", r, 2, "127.0.0.1", port, secret, timeout=60, integrity=integrity)
                x = torch.ones(nbytes // 4)
                c.all_reduce(x)
                t = time.perf_counter()
                for _ in range(rounds):
                    c.all_reduce(x)
                got[r] = (time.perf_counter() - t) / rounds
                c.close()

            ts = [threading.Thread(target=go, args=(r,)) for r in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            res[integrity] = max(got.values())
        out.append(
            {
                "bytes": nbytes,
                "header_s": res["header"],
                "full_s": res["full"],
                "full_over_header": res["full"] / res["header"],
            }
        )
        print(
            f"{nbytes >> 10} KiB: header {res['header'] * 1e3:.2f} ms, full {res['full'] * 1e3:.2f} ms, "
            f"ratio {res['full'] / res['header']:.2f}",
            flush=True,
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--integrity", action="store_true", help="measure --integrity full against header instead")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--checkpoints", action="store_true", help="the checkpoint faults instead (damage, then resume)")
    a = ap.parse_args()
    if a.integrity:
        rows = integrity_cost(a.rounds)
    elif a.checkpoints:
        rows = []
        with tempfile.TemporaryDirectory(prefix="bench-faults-ck-") as tmp:
            sf = os.path.join(tmp, "secret")
            fd = os.open(sf, os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
            os.close(fd)
            for s in a.strategies.split(","):
                rows += checkpoint_cells(s, sf, tempfile.mkdtemp(dir=tmp))
    else:
        rows = []
        with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
            sf = os.path.join(tmp, "secret")
            secret = secrets.token_hex(32).encode()
            fd = os.open(sf, os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, secret + b"\n")
            os.close(fd)
            for s in a.strategies.split(","):
                for f in a.faults.split(","):
                    d = tempfile.mkdtemp(dir=tmp)
                    row = cell(s, f, sf, secret, d)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if a.json:
        from smolnet.files import write_json_atomic

        write_json_atomic(a.json, {"schema": "smolcluster.bench.faults/1", "rows": rows}, indent=1)
    if a.integrity:  # a measurement with no bar here (bench_allreduce --full-integrity keeps that one)
        return 0
    return verdict(rows, a.checkpoints)


def verdict(rows: list[dict], checkpoints: bool) -> int:
    """Keep the result (bench/results/faults*.json) and exit by the bar."""
    ok = [r for r in rows if (ck_ok if checkpoints else cell_ok)(r)]
    missed = [f"{r['strategy']} {r['fault']}" for r in rows if r not in ok]
    headline = f"{len(ok)} of {len(rows)}" + (f"; missed {', '.join(missed)}" if missed else "")
    if not checkpoints:
        times = [r["detect_s"] for r in rows if r.get("detect_s") is not None]
        headline += f", detection {min(times):g}-{max(times):g} s" if times else ""
    name, bar = ("faults-checkpoints", CK_BAR) if checkpoints else ("faults", BAR)
    met = bool(rows) and not missed
    kept = write_result(name, bar, met, headline, {"rows": rows})
    print(f"{headline}: {'met' if met else 'MISSED'} ({kept})")
    return exit_code(met)


if __name__ == "__main__":
    sys.exit(main())
