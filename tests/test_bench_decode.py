"""bench_compute's and bench_decode_rounds' decode runs (bench/compute_decode.py): every
strategy's generate gets the rounds asked for. The generate itself is replaced here by one that
records its command line and writes a report; the benches run the real one on the sims."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _compute_decode(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_compute_decode_module", ROOT / "bench" / "compute_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_strategy_decodes_the_rounds_asked_for(monkeypatch, tmp_path):
    mod = _compute_decode(monkeypatch)
    (tmp_path / "links.json").write_text(json.dumps({"hosts": ["a", "b"]}))
    seen = []

    def fake_sh(argv, ok=(0,)):
        argv = [str(a) for a in argv]
        seen.append(argv)
        rounds = int(argv[argv.index("--rounds") + 1])
        rates = [100.0 + i for i in range(rounds)]
        doc = {
            "plan": {"tokens_per_s": 100.0},
            "decode": {"tokens_per_s": sum(rates) / rounds, "tokens_per_s_rounds": rates},
            "placement": {"order": ["a", "b"]},
        }
        if "pp" in argv:  # generate's terms against the plan: a's stage 2x slow
            stage = [{"name": n, "ratio": x} for n, x in (("a", 2.0), ("b", 1.1))]
            doc["decode"]["vs_plan"] = {"ranks": stage, "rest": {"ratio": 0.6}, "outside": ["stage on a x2.00"]}
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(doc))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(mod, "sh", fake_sh)
    rows = mod.run_decode(tmp_path / "inv.yml", tmp_path, tmp_path / "model", ("pp", "tp"), rounds=3)
    assert [a[a.index("--strategy") + 1] for a in seen] == ["pp", "tp"]
    assert [a[a.index("--rounds") + 1] for a in seen] == ["3", "3"]  # not the first run's rates
    assert [len(r["rounds"]) for r in rows] == [3, 3] and all("error" not in r for r in rows)
    assert rows[0]["terms"] == {"stages": {"a": 2.0, "b": 1.1}, "rest": 0.6, "outside": ["stage on a x2.00"]}
    assert "terms" not in rows[1]
    table = mod.lines(rows)
    assert table[-2].endswith("| stage on a x2.00 |") and table[-1].endswith("| - |")
