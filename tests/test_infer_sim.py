"""`smoltrain generate -i` over the sim: ranks started over SSH in their own network namespaces,
the checkpoint read from the same path on every host, tokens equal to transformers', bytes per
link attributed to host names and equal to the plan's per token.

Needs root and network namespaces; skips cleanly without them. Sim "i1" on 10.44.0.0/24 is
always torn down.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from infer_models import make_checkpoint, reference

pytestmark = [pytest.mark.sim, pytest.mark.slow]

from need import sim_cluster  # noqa: E402

PROMPT, NEW = [3, 5, 7, 9], 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with sim_cluster(tmp_path_factory, "i1", scenario="uniform", hosts=2, subnet="10.44.0.0/24") as (st, inv, d):
        path = make_checkpoint(str(d / "llama"), "llama", layers=3)
        yield st, inv, d, path, reference(path, PROMPT, NEW)


@pytest.mark.parametrize("strategy", ["pp", "tp"])
def test_generate_across_sim_hosts(cluster, strategy):
    st, inv, d, path, want = cluster
    out = d / f"{strategy}.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "smoltrain",
            "generate",
            "--strategy",
            strategy,
            "-i",
            str(inv),
            "--model",
            path,
            "--prompt-ids",
            ",".join(map(str, PROMPT)),
            "--max-new-tokens",
            str(NEW),
            "--ignore-eos",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    doc = json.loads(out.read_text())
    names = [h["name"] for h in st["hosts"]]
    assert doc["hosts"] == names and doc["output_ids"] == want
    assert {(x["src"], x["dst"]) for x in doc["links"]} == {(names[0], names[1]), (names[1], names[0])}
    assert doc["decode"]["bytes_per_token"] == pytest.approx(doc["plan"]["bytes_per_token"], rel=0.02)
