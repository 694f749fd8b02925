"""Issue 25, end to end: quantised generation, activations on the wire, threads and devices per
rank, bf16 training, and the refusals (one line, exit 2, nothing started).

The model is a small random Llama whose greedy choices win by clear margins (weights drawn
wide), with hidden 64 so q4 groups of 32 line up with a tp split of 2 ranks: each rank's
share of a matrix row is whole groups, as in the one-process model."""

from __future__ import annotations

import json
import os
import sys

import pytest

from smolnet.cpus import usable_cpus
from smoltrain.cli import main
from smoltrain.schema import check_any

PROMPT = "3,5,7,9,11"
NEW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from infer_models import make_checkpoint

    path = str(tmp_path_factory.mktemp("hf") / "llama64")
    return make_checkpoint(path, "llama", layers=2, hidden=64, init=0.3, rope_theta=10000.0)


def generate(tmp_path, model, *extra) -> dict:
    out = tmp_path / f"gen{len(list(tmp_path.iterdir()))}.json"
    argv = ["generate", "--model", model, "--prompt-ids", PROMPT, "--max-new-tokens", str(NEW), "--ignore-eos"]
    assert main([*argv, "--json", str(out), *extra]) == 0
    doc = json.loads(out.read_text())
    check_any(doc)
    return doc


@pytest.fixture(scope="module")
def local(model, tmp_path_factory):
    """The one-process runs everything else is held against: fp32, int8 and q4."""
    tmp = tmp_path_factory.mktemp("local")
    cpus = usable_cpus()
    return {
        q: generate(tmp, model, "--strategy", "local", "--threads", str(cpus), *(["--quantize", q] if q else []))
        for q in (None, "int8", "q4")
    }


def test_int8_equals_fp32_and_decode_reports_its_bound(local):
    fp32, int8, q4 = local[None], local["int8"], local["q4"]
    assert int8["output_ids"] == fp32["output_ids"]
    assert len(set(fp32["output_ids"])) > 2
    assert q4["quantize"] == "q4" and len(q4["output_ids"]) == NEW
    # one process, all the CPUs this machine lets it use
    assert fp32["threads"] == {"rank0": usable_cpus()} and fp32["devices"] == {"rank0": "cpu"}
    d32, d8, d4 = fp32["decode"], int8["decode"], q4["decode"]
    # weights read per token shrink with the width (embedding rows and norms stay fp32)
    assert d32["weight_bytes_per_token"] > d8["weight_bytes_per_token"] > d4["weight_bytes_per_token"]
    for d in (d32, d8, d4):
        assert d["roofline_tokens_per_s"] > 0
        # each rank's decode CPU, by name, adding up to the total
        assert set(d["cpu_s_per_rank"]) == {"rank0"} and d["cpu_s_per_rank"]["rank0"] == pytest.approx(d["cpu_s"])
        assert d["cpu_s"] > 0


def inventory(tmp_path) -> tuple[str, str]:
    """Two hosts on this machine (loopback addresses), each given one thread and the cpu device."""
    from smoltrain.comm.group import free_port_base

    inv = tmp_path / "hosts.yml"
    port = free_port_base(2, "127.0.0.2")
    inv.write_text(
        "cluster:\n  hosts:\n"
        f"    alpha:\n      ansible_connection: local\n      cluster_ip: 127.0.0.2\n      smol_threads: 1\n"
        f"      smol_device: cpu\n      smol_python: {sys.executable}\n      smol_train_port: {port}\n"
        f"    beta:\n      ansible_connection: local\n      cluster_ip: 127.0.0.3\n      smol_threads: 1\n"
        f"      smol_python: {sys.executable}\n"
    )
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    os.chmod(secret, 0o600)
    return str(inv), str(secret)


@pytest.mark.parametrize("strategy", ["pp", "tp"])
def test_split_quantised_equals_local_and_int8_wire_bytes_match_the_plan(local, model, tmp_path, strategy):
    """pp on inventory hosts (smol_threads 1 each), tp on --local 2 --threads 1."""
    if strategy == "pp":
        inv, secret = inventory(tmp_path)
        where, names = ["-i", inv, "--secret-file", secret], ("alpha", "beta")
    else:
        where, names = ["--local", "2", "--threads", "1"], ("rank0", "rank1")
    doc = generate(tmp_path, model, "--strategy", strategy, *where, "--quantize", "q4", "--wire-dtype", "int8")
    assert doc["output_ids"] == local["q4"]["output_ids"]
    assert doc["threads"] == {names[0]: 1, names[1]: 1}
    assert doc["devices"][names[0]] == "cpu"
    # pp: one hidden state per hop, 64 int8 values and one fp32 scale: 68 bytes (the token id
    # back is the last stage's 8). tp: 2 all-reduces per layer x 2 layers, each an all-gather
    # sending the other rank's 68 bytes: 4 x 68 = 272. Both: rank 0's 32-byte step header
    want = (68 if strategy == "pp" else 272) + 32
    assert doc["decode"]["bytes_per_token"] == want
    assert doc["plan"]["bytes_per_token"] == want
    assert doc["wire_dtype"] == "int8" and doc["plan"]["wire_dtype"] == "int8"


def test_bf16_training_keeps_fp32_state_and_reports_threads(tmp_path):
    docs = {}
    for dtype in ("fp32", "bf16"):
        out = tmp_path / f"{dtype}.json"
        argv = ["run", "--strategy", "dp", "--local", "1", "--threads", "1", "--steps", "2", "--batch", "2"]
        assert main([*argv, "--seq", "32", "--dtype", dtype, "--json", str(out), "--out", str(tmp_path)]) == 0
        docs[dtype] = json.loads(out.read_text())
        check_any(docs[dtype])
    fp32, bf16 = docs["fp32"], docs["bf16"]
    assert bf16["threads"] == {"rank0": 1} and bf16["config"]["dtype"] == "bf16"
    # same start, bf16 matmuls: the losses differ, but only in the rounding
    a, b = fp32["steps"][0]["loss"], bf16["steps"][0]["loss"]
    assert a != b and abs(a - b) < 0.02 * a
    # master weights and AdamW moments stay fp32: the same state bytes as the fp32 run
    assert bf16["state_bytes"] == fp32["state_bytes"]
    assert bf16["plan"]["compute_dtype"] == "bf16"


def one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


@pytest.mark.parametrize(
    "extra,want",
    [
        (["--quantize", "q3"], "--quantize q3: choose from int8, q4"),
        (["--wire-dtype", "fp8"], "--wire-dtype fp8"),
        (["--threads", "0"], "at least 1"),
        (["--threads", "512"], "may use"),
        (["--dtype", "bf16", "--device", "cuda"], "smol_device cuda"),
    ],
)
def test_bad_machine_options_refused_before_any_rank(capsys, model, tmp_path, extra, want):
    out = tmp_path / "never.json"
    argv = ["generate", "--model", model, "--prompt-ids", PROMPT, "--local", "2", "--json", str(out)]
    err = one_line(capsys, [*argv, *extra])
    assert want in err
    assert not out.exists()


def test_run_refuses_bad_threads_and_dtype(capsys, tmp_path):
    argv = ["run", "--strategy", "dp", "--local", "1", "--steps", "1", "--json", str(tmp_path / "r.json")]
    assert "may use" in one_line(capsys, [*argv, "--threads", "512"])
    assert "--dtype fp16" in one_line(capsys, [*argv, "--dtype", "fp16"])
    assert not (tmp_path / "r.json").exists()


PORT_CLASH = """
import json, random, socket, sys
import torch
from smoltrain.calibration import comm_probe
from smoltrain.comm import group

held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen()
busy = held.getsockname()[1]
first = iter([busy])  # the first candidate: the held port as the rendezvous
real = random.Random.randrange
random.Random.randrange = lambda self, *a: next(first, None) or real(self, *a)
random.randrange = lambda *a: random.Random.randrange(random._inst, *a)  # the module's function too
group._ephemeral_low = lambda default=32768: 65535
print(json.dumps(comm_probe.comm_cpu(torch, window=0.05)))
"""


def test_comm_probe_takes_a_free_port_when_its_first_pick_is_held():
    """The probe's port is checked: with the first candidate held by another program, it
    measures on the next free one instead of losing the CPU model (a fresh process, as
    calibrate runs the probe: it forks)."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", PORT_CLASH], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-500:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got is not None and got["message_s"] > 0 and got["bytes_s"] > 0


SPARE = """
import json, os
from smoltrain.host import spare_core
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, cpus[:1])
one = [spare_core(1)]
os.sched_setaffinity(0, cpus[:2])
print(json.dumps(one + [spare_core(1), spare_core(2)]))
"""


def test_a_core_is_spare_for_sends_only_beside_fewer_threads_than_cpus():
    """dp overlaps its all-reduces with backward only where this says a core is free: one CPU
    and one thread has none, two CPUs and one thread one, two and two none (a one-CPU machine
    checks the first)."""
    import subprocess

    r = subprocess.run([sys.executable, "-c", SPARE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-500:]
    want = [False, True, False] if len(os.sched_getaffinity(0)) >= 2 else [False, False, False]
    assert json.loads(r.stdout) == want


def test_a_host_paced_below_half_a_core_by_a_cap_it_cannot_read_runs_one_thread(tmp_path):
    """A hidden 0.24-core cap ran two threads on two visible CPUs and decoded at 0.31 of plan:
    the launcher gives a host one thread where calibration measured its busy thread at half a
    core or less without a cap it reads; a readable cap, a host slowed a little by other work
    and an inventory without a report of these hosts keep what they had."""
    from computetools import compute_doc

    from smolnet.inventory import Host
    from smoltrain.run.threads import cap_threads, inventory_threads

    doc = compute_doc(["hidden", "read", "busy", "free"], "free")
    paces = {"hidden": 4.5, "read": 6.7, "busy": 1.3, "free": None}
    for h in doc["hosts"]:
        h["cpu_limit_cores"] = 0.15 if h["name"] == "read" else None
        h["cpu_pace"] = paces[h["name"]]
    report = tmp_path / "compute.json"
    report.write_text(json.dumps(doc))
    hosts = [
        Host(name=n, address=f"10.0.0.{i}", cluster_ip=f"10.0.0.{i}", threads=t)
        for i, (n, t) in enumerate((("hidden", 2), ("read", None), ("busy", 4), ("free", None)), start=1)
    ]
    caps = cap_threads(hosts, str(report))
    assert caps == {"hidden": 1}
    assert inventory_threads(hosts, caps) == [1, 0, 4, 0]
    assert inventory_threads(hosts) == [2, 0, 4, 0]
    assert cap_threads(hosts + [Host(name="other", address="10.0.0.9", cluster_ip="10.0.0.9")], str(report)) == {}
