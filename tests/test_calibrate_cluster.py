"""`smoltrain calibrate -i`: every host measured on itself, failures reported, caps ranked."""

from __future__ import annotations

import json
import sys

import pytest

from smolnet.inventory import Host
from smoltrain.calibration.cluster import COMPUTE_SCHEMA, calibrate_hosts
from smoltrain.cli import main
from smoltrain.schema import check_any


def _local(name: str) -> Host:
    return Host(name=name, address="127.0.0.1", cluster_ip="127.0.0.1", local=True, python=sys.executable)


def test_unreachable_host_is_reported_and_the_rest_measured():
    """The probe runs for real on a; b, on the same machine, takes a's figures (a second real
    probe would add ten seconds and check nothing new), so for b the order it is measured in
    and its machine id are what count."""
    from smoltrain.calibration.cluster import probe_host

    dead = Host(name="gone", address="127.0.0.1", cluster_ip="127.0.0.1", port=1, user="root")
    seen, first = [], []

    def probe(h, model, seconds):
        if not first:
            first.append(probe_host(h, model, seconds, quick=True))
        return {**first[0], "name": h.name}

    hosts = [_local("a"), dead, _local("b")]
    doc = calibrate_hosts(hosts, "tiny", 0.05, progress=lambda n, w: seen.append((n, w)), probe=probe)
    assert doc["schema"] == COMPUTE_SCHEMA
    a, gone, b = doc["hosts"]
    assert gone["status"] == "failed" and gone["error"] and gone["name"] == "gone"
    for h in (a, b):
        assert h["status"] == "ok" and h["flops"]["fp32"] > 0 and h["mem_bw_bytes_s"] > 0
        assert [s["batch"] for s in h["train_step"]] == [2, 8]
        assert all(s["seconds"] > 0 and s["model"] == "tiny" for s in h["train_step"])
        assert all(s["optimizer_seconds"] > 0 for s in h["train_step"])  # how they compare: bench_calibrate
        assert h["cores"] >= 1 and h["usable_memory_bytes"] > 0 and "cpu_limit_cores" in h
        # decode's weight reads, timed per dtype and rows in the layers' own product
        assert sorted(h["decode_bw_bytes_s"]) == ["bf16", "fp32"]
        assert all(sorted(r) == ["1", "4", "8"] and min(r.values()) > 0 for r in h["decode_bw_bytes_s"].values())
        # and what a layer costs beyond its products, timed in a real block (its rule for noisy
        # pairs: test_layer_overhead_never_falls_with_more_rows)
        assert sorted(h["decode_layer_s"]) == ["bf16", "fp32"]
        fp = h["decode_layer_s"]["fp32"]
        assert sorted(fp) == ["1", "4", "8"] and min(fp.values()) >= 0
        # and a decode step's per-token cost: one token through the model, timed
        (dec,) = h["decode_step"]
        assert dec["model"] == "tiny" and dec["seconds"] > 0
    check_any({**doc, "hosts": [a, b]})
    assert a["machine_id"] == b["machine_id"]  # one machine: measured one after another
    # read with the machine id: no cap here, or one both share (a container): not together
    (m,) = doc["machines"]
    assert m["hosts"] == ["a", "b"] and m["machine_id"] == a["machine_id"] and not m["together"]
    order = [n for n, w in seen if w == "measuring"]
    assert order == ["a", "b"]
    assert any(n == "gone" and w.startswith("failed") for n, w in seen)


def test_layer_overhead_never_falls_with_more_rows(monkeypatch):
    """A layer's cost beyond its products is the block's time less its products' time, per
    layer, at the host's pace; a noisy pair that would make more rows cost less keeps the
    fewer rows' figure. The timer is scripted (the real one runs in the test above): 1 row
    takes 2 s more whole than its products alone, 4 rows (noisy) 1, 8 rows 8."""
    import torch

    from smoltrain.calibration import decode_probe

    timed = iter([2.0, 1.0, 8.0] * 2)  # fp32, then bf16
    monkeypatch.setattr(decode_probe, "cpu_seconds_more", lambda fn, than, calls=None: next(timed))
    got = decode_probe._overhead(torch, 2.0, decode_probe.OVERHEAD_CALLS)
    per = decode_probe.OVERHEAD_LAYERS
    assert got["fp32"] == pytest.approx({"1": 2 / per * 2, "4": 2 / per * 2, "8": 8 / per * 2})


def test_what_a_call_costs_beyond_another_is_the_median_of_back_to_back_pairs(monkeypatch):
    """A scripted CPU clock: the block costs 3 s and its products 1, and one of the seven
    pairs has its block hit by 50 s of something else (a throttle's cold slices, a busy
    neighbour): the figure is still 2, where the difference of two medians taken apart
    would move with whichever call the outlier lands in."""
    from smoltrain.calibration import decode_probe

    clock = {"t": 0.0, "calls": 0}

    def block():
        clock["calls"] += 1
        clock["t"] += 3.0 + (50.0 if clock["calls"] == 4 else 0.0)

    def products():
        clock["t"] += 1.0

    monkeypatch.setattr(decode_probe.time, "process_time", lambda: clock["t"])
    assert decode_probe.cpu_seconds_more(block, products, 7) == pytest.approx(2.0)
    assert clock["calls"] == 8  # one warm-up call, then seven timed


def test_cli_writes_the_report_and_exits_4_when_a_host_failed(tmp_path, capsys):
    inv = tmp_path / "hosts.yml"
    inv.write_text(f"""all:
  children:
    cluster:
      hosts:
        here: {{ansible_connection: local, ansible_host: 127.0.0.1}}
        gone: {{ansible_host: 127.0.0.2, ansible_port: 1, ansible_user: root}}
      vars: {{smol_python: {sys.executable}}}
""")
    out = tmp_path / "compute.json"
    argv = ["calibrate", "-i", str(inv), "--seconds", "0.05", "--model", "none", "--repeat", "2", "--quick"]
    rc = main(argv + ["--out", str(out)])
    assert rc == 4
    doc = json.loads(out.read_text())
    assert [h["status"] for h in doc["hosts"]] == ["ok", "failed"] and doc["settings"]["quick"] is True
    assert doc["hosts"][0]["repeats"] == 2 and len(doc["hosts"][0]["fp32_flops_each"]) == 2
    assert "gone" in capsys.readouterr().out


def test_repeat_out_of_range_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["calibrate", "--local", "--repeat", "0", "--out", str(out)]) == 2
    assert "--repeat: must be an integer at least 1 and at most 20" in capsys.readouterr().err and not out.exists()


def test_local_writes_a_compute_report(tmp_path):
    out = tmp_path / "c.json"
    assert main(["calibrate", "--local", "--seconds", "0.05", "--model", "none", "--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == COMPUTE_SCHEMA and len(doc["hosts"]) == 1 and doc["hosts"][0]["train_step"] == []
    assert doc["settings"]["quick"] is True


def test_quick_without_a_compute_report_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["calibrate", "--quick", "--out", str(out)]) == 2
    assert "--quick: only with -i INVENTORY or --local" in capsys.readouterr().err and not out.exists()


def test_quick_shortens_every_window_of_the_probe_and_none_of_the_ring(monkeypatch):
    """--quick reaches each host's probe (its argv), and QUICK is shorter than FULL in every
    window: one kernel window, the pace and message loops at the shortest window, one window of
    training steps, fewer layer pairs. The wire ring keeps its window either way (a shorter one
    read a higher message cost)."""
    from smoltrain.calibration import cluster, probe, wire_probe

    h = _local("a")
    assert "--quick" in cluster.probe_argv(h, "tiny", 0.3, quick=True)
    assert "--quick" not in cluster.probe_argv(h, "tiny", 0.3)
    assert wire_probe.argv_for(h, 0, ["a", "b"], 9000)[-2:] == ["--window", f"{wire_probe.WINDOW:g}"]
    q, f = probe.QUICK, probe.FULL
    assert q.kernel < f.kernel and q.pace_s < f.pace_s and q.comm_s < f.comm_s and q.train < f.train
    assert q.pairs < f.pairs and q.pace_s >= probe.WINDOW_MIN and q.comm_s >= probe.WINDOW_MIN
    windows = []
    ring = lambda hosts, **kw: windows.append(kw.get("window", wire_probe.WINDOW)) or {}  # noqa: E731
    monkeypatch.setattr(wire_probe, "measure", ring)
    entry = {"comm_cpu": {"message_s": 1e-4, "bytes_s": 1e9}, "error": None}
    doc = {"hosts": [{"name": "a", **entry}, {"name": "b", **entry}]}
    wire_probe.apply([h, _local("b")], doc)
    assert windows == [wire_probe.WINDOW]


def test_kernel_rate_drops_the_warm_up_and_takes_the_median_window(monkeypatch):
    """One slow window (a VM's first half second) must not decide a kernel's figure, and the
    fastest window must not either (under a quota it measures the uncapped machine)."""
    from smoltrain.calibration import probe

    clock = [0.0]
    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    # seconds per call: slow while warming up, then three windows at 1, 3 and 2 ms a call
    phases = [(0.05, 0.010), (0.05, 0.001), (0.05, 0.003), (0.05, 0.002)]

    def call():
        spent = clock[0]
        for length, per_call in phases:
            if spent < length:
                clock[0] += per_call
                return
            spent -= length
        clock[0] += 0.002

    rate = probe.steady_rate(call, 0.1)  # half-windows of 50 ms: one per phase
    assert abs(rate - 500) < 30, rate  # the median window (2 ms a call), not 1 ms or 10 ms


def test_a_bursts_wake_is_the_median_of_cold_and_warm_pairs(monkeypatch):
    """decode_probe.burst_wake: a burst after a sleep against the same burst at once, paired;
    a scripted CPU clock where the cold burst costs 3 s and the warm 1, and one pair's cold
    burst 50 s more (a neighbour's spell): the figure is 2, and each pair slept first."""
    import torch

    from smoltrain.calibration import decode_probe

    clock = {"t": 0.0, "reads": 0}
    costs = iter([c for k in range(decode_probe.WAKE_CALLS) for c in ((53.0 if k == 3 else 3.0), 1.0, 0.0)])

    def read():
        clock["reads"] += 1
        t = clock["t"]
        clock["t"] += next(costs)
        return t

    slept = []
    monkeypatch.setattr(decode_probe.time, "process_time", read)
    monkeypatch.setattr(decode_probe.time, "sleep", slept.append)
    assert decode_probe.burst_wake(torch) == pytest.approx(2.0)
    assert slept == [decode_probe.WAKE_IDLE_S] * decode_probe.WAKE_CALLS
    assert clock["reads"] == 3 * decode_probe.WAKE_CALLS


def test_repeats_take_each_figures_median_round_by_round():
    """A fake probe whose figures differ per round (the real probe runs in the tests above):
    each figure is the median of its rounds, and a shared machine's hosts alternate."""
    rounds = {"a": iter([1.0, 9.0, 3.0]), "b": iter([5.0, 4.0, 6.0])}
    calls = []

    def fake_probe(h, model, seconds):
        calls.append(h.name)
        x = next(rounds[h.name])
        return {
            "name": h.name,
            "status": "ok",
            "error": None,
            "flops": {"fp32": x * 1e9, "bf16": 2 * x * 1e9},
            "mem_bw_bytes_s": 10 * x,
            "usable_memory_bytes": int(100 * x),
            "comm_cpu": {"message_s": x, "bytes_s": 1 / x},
            "decode_bw_bytes_s": {"fp32": {"1": 4 * x, "8": 2 * x}},
            "decode_layer_s": {"fp32": {"1": x / 10, "8": x / 5}},
            "train_step": [{"model": "tiny", "batch": 2, "seq": 64, "seconds": x, "optimizer_seconds": x / 10}],
            "decode_step": [{"model": "tiny", "seconds": x / 100}],
        }

    doc = calibrate_hosts([_local("a"), _local("b")], "tiny", 0.05, probe=fake_probe, repeats=3)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    a, b = doc["hosts"]
    assert a["flops"] == {"fp32": 3e9, "bf16": 6e9} and a["mem_bw_bytes_s"] == 30
    assert a["usable_memory_bytes"] == 100  # the least memory any round saw
    assert a["comm_cpu"] == {"message_s": 3.0, "bytes_s": 1 / 3}
    assert a["decode_bw_bytes_s"] == {"fp32": {"1": 12.0, "8": 6.0}}
    assert a["decode_layer_s"] == {"fp32": {"1": pytest.approx(0.3), "8": pytest.approx(0.6)}}
    assert a["train_step"][0]["seconds"] == 3.0 and a["train_step"][0]["optimizer_seconds"] == 0.3
    assert a["decode_step"][0]["seconds"] == 0.03
    assert a["repeats"] == 3 and a["fp32_flops_each"] == [1e9, 9e9, 3e9]
    assert b["flops"]["fp32"] == 5e9 and doc["settings"]["repeats"] == 3


def test_a_session_probes_every_round_in_one_process_and_names_why_it_ended():
    """calibration.session: one process answers each round (it starts once), and a process
    that ends instead of answering is reported with its last line of stderr."""
    from smolnet.remote import RemoteError
    from smoltrain.calibration.session import ProbeSession

    echo = (
        "import json, os, sys\nfor n, _ in enumerate(sys.stdin):\n    print(json.dumps([os.getpid(), n]), flush=True)"
    )
    with ProbeSession(_local("a"), [sys.executable, "-c", echo], timeout=30) as s:
        (pid, first), (again, second) = s.probe(), s.probe()
    assert pid == again and (first, second) == (0, 1)
    dies = "import sys; sys.stdin.readline(); print('probe failed: MemoryError: out', file=sys.stderr); sys.exit(1)"
    with (
        ProbeSession(_local("a"), [sys.executable, "-c", dies], timeout=30) as s,
        pytest.raises(RemoteError, match="a: probe failed: MemoryError: out"),
    ):
        s.probe()


def test_the_probe_starts_from_the_servers_the_workers_use():
    """The probe pays torch's import in the host's warm server of training workers, so the runs
    after a calibrate fork from it instead of importing again: the same preload list, and the
    same key as `python -m smoltrain worker` started from the same place."""
    from smolnet import warm
    from smoltrain.calibration.cluster import probe_argv
    from smoltrain.run import WORKER_IMPORTS

    argv = probe_argv(_local("a"), "tiny", 0.3)
    cut = argv.index("--")
    assert argv[1:cut] == ["-m", "smolnet.warm", "--preload", ",".join(WORKER_IMPORTS)]
    assert argv[cut + 1 : cut + 3] == ["smoltrain.calibration.probe", "--serve"]
    assert warm.key(WORKER_IMPORTS, argv[cut + 1]) == warm.key(WORKER_IMPORTS, "smoltrain")
