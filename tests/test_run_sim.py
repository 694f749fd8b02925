"""`smoltrain run -i` over the sim: workers started over SSH inside their own network
namespaces, training traffic on the sim subnet, bytes attributed to host names.

Needs root and network namespaces; skips cleanly without them. Sim "r1" on
10.213.41.0/24 is always torn down.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from smoltrain.schema import check_any

pytestmark = pytest.mark.sim

from need import sim_cluster  # noqa: E402


@pytest.fixture(scope="module")
def uniform(tmp_path_factory):
    with sim_cluster(tmp_path_factory, "r1", scenario="uniform", hosts=2, subnet="10.213.41.0/24") as c:
        yield c


def test_dp_over_ssh_on_the_sim(uniform):
    st, inv, d = uniform
    out = d / "run.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "run",
            "--strategy",
            "dp",
            "-i",
            str(inv),
            "--steps",
            "3",
            "--batch",
            "6",
            "--seq",
            "32",
            "--json",
            str(out),
            "--out",
            str(d),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    doc = check_any(json.loads(out.read_text()))
    names = [h["name"] for h in st["hosts"]]
    assert doc["hosts"] == names and doc["world_size"] == 2
    assert {(b["src"], b["dst"]) for b in doc["bytes"]} == {(names[0], names[1]), (names[1], names[0])}
    assert all(b["bytes"] == 3 * 721344 * 4 for b in doc["bytes"])  # 2(N-1)/N of the fp32 gradient per step
