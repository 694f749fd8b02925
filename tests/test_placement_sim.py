"""`smoltrain run -i --placement auto` over the sim: the measured-speed placement cuts the layers
unevenly (workers start on the hosts in the placement's order, over SSH in their namespaces;
the order is the plan's best, the inventory's where orders tie), and the loss curve still
matches `--local 1`.

Needs root and network namespaces; skips cleanly without them. Sim "pl" on 10.43.0.0/24 is
always torn down.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.sim, pytest.mark.slow]

from computetools import write_compute  # noqa: E402
from need import sim_cluster  # noqa: E402
from runtools import smoltrain as run_cli  # noqa: E402


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    with sim_cluster(tmp_path_factory, "pl", scenario="uniform", hosts=3, subnet="10.43.0.0/24") as c:
        yield c


def test_pp_auto_placement_on_the_sim_reorders_and_matches_local_1(three):
    st, inv, d = three
    names = [h["name"] for h in st["hosts"]]
    fast = names[-1]
    write_compute(d / "compute.json", names, fast, seq=32)
    common = ["--steps", "3", "--batch", "6", "--seq", "32", "--seed", "5", "--microbatches", "2", "--out", str(d)]
    p = run_cli("run", "--strategy", "pp", "-i", inv, "--compute", d / "compute.json", "--json", d / "pp.json", *common)
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    r = run_cli("run", "--strategy", "dp", "--local", "1", "--json", d / "ref.json", *common)
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
    doc, ref = json.loads((d / "pp.json").read_text()), json.loads((d / "ref.json").read_text())
    pl = doc["placement"]
    assert pl["mode"] == "auto" and doc["hosts"] == pl["order"]  # the ranks start in the placement's order
    cut = dict(zip(pl["order"], pl["layers"]))[fast]
    assert cut[1] - cut[0] > 2  # the fast host takes more than an even share
    for a, b in zip((s["loss"] for s in doc["steps"]), (s["loss"] for s in ref["steps"])):
        assert abs(a - b) <= 1e-5 * abs(b)
