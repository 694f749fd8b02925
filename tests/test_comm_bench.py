"""`smoltrain bench allreduce`: the contract document, on loopback and over SSH on the sim.

The sim test uses sim "x1" on 10.213.31.0/24 and always tears it down. No timing is
asserted anywhere: only that the numbers are consistent with each other.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from need import sim_up

from smoltrain.schema import check_any

FIELDS = {"schema", "op", "backend", "world_size", "bytes", "iters", "seconds_p50", "algbw_gbps", "busbw_gbps"}


def bench(*args, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "smoltrain", "bench", "allreduce", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_doc(doc: dict, backend: str, n: int, nbytes: int, iters: int) -> None:
    assert set(doc) >= FIELDS
    check_any(doc)
    assert (doc["schema"], doc["op"], doc["backend"]) == ("smoltrain.bench/1", "allreduce", backend)
    assert (doc["world_size"], doc["bytes"], doc["iters"]) == (n, nbytes, iters)
    assert doc["seconds_p50"] > 0
    assert doc["algbw_gbps"] == pytest.approx(nbytes / doc["seconds_p50"] / 1e9)
    assert doc["busbw_gbps"] == pytest.approx(doc["algbw_gbps"] * 2 * (n - 1) / n)
    if backend == "socket":  # measured by the transport: the ring's textbook volume, exactly
        assert doc["payload_bytes_per_iter_rank0"] == 2 * (n - 1) * nbytes // n
        assert doc["framing_bytes_per_iter_rank0"] > 0


@pytest.mark.parametrize("backend,n", [("socket", 3), ("torch", 2)])
def test_bench_local_writes_the_contract_document(tmp_path, backend, n):
    out = tmp_path / "ar.json"
    p = bench(
        "--local", str(n), "--bytes", "96K", "--backend", backend, "--iters", "3", "--warmup", "1", "--json", str(out)
    )
    assert p.returncode == 0, p.stderr[-2000:]
    check_doc(json.loads(out.read_text()), backend, n, 96 * 1024, 3)
    assert "busbw" in p.stdout


@pytest.mark.parametrize(
    "args,why",
    [
        (["--local", "2", "--bytes", "lots"], "--bytes"),
        (["--bytes", "4K"], "--local N or -i"),
        (["--local", "0", "--bytes", "4K"], "--local"),
    ],
)
def test_bench_bad_input_is_one_line_and_exit_2(args, why):
    p = bench(*args, timeout=60)
    assert p.returncode == 2 and why in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.sim
def test_bench_over_ssh_on_the_sim(tmp_path):
    from smolnet.sim import cluster as sim

    inv = tmp_path / "x1.yml"
    sim_up(sim, name="x1", scenario="uniform", hosts=2, subnet="10.213.31.0/24", rate_mbit=1000, inventory=str(inv))
    try:
        out = tmp_path / "ar.json"
        p = bench("-i", str(inv), "--bytes", "1M", "--iters", "3", "--warmup", "1", "--json", str(out))
        assert p.returncode == 0, p.stderr[-2000:]
        check_doc(json.loads(out.read_text()), "socket", 2, 1 << 20, 3)
    finally:
        sim.down(name="x1")
