"""Link report: judging raw figures, the smolnet.links/1 schema, Markdown and PNG rendering.

The raw inputs here have the shape the agents return; tests/test_matrix_sim.py runs the
same path on real measurements.
"""

from __future__ import annotations

import copy
import json

import pytest

from smolnet import report


def host(name, mtu=1500, rate=1000.0):
    return {
        "name": name,
        "address": f"10.0.0.{len(name)}",
        "iface": "eth0",
        "mtu_configured": mtu,
        "link_rate_mbit": rate,
        "device": "generic",
        "status": "ok",
        "error": None,
    }


def tput(x, cpu=False, method="iperf3"):
    return {"method": method, "throughput_mbit": x, "connected": True, "retransmits": 0, "cpu_limited": cpu}


RTT = {"min": 30.0, "p50": 40.0, "p90": 50.0, "p99": 90.0, "max": 300.0, "samples": 300}


def raw(src, dst, x, eff=1500, **extra):
    r = {"src": src, "dst": dst, "rtt": dict(RTT), "pmtu": {"mtu_effective": eff, "error": None}, "tput": tput(x)}
    r.update(extra)
    return r


@pytest.fixture
def home():
    hosts = [host("pi5"), host("jetson"), host("macmini", 9000, 2500), host("laptop", 9000)]
    raws = []
    for a in hosts:
        for b in hosts:
            if a is b:
                continue
            x, eff = 955.0, 1500
            if a["name"] == "jetson":
                x = 287.0
            if {a["name"], b["name"]} == {"macmini", "laptop"}:
                x, eff = 0.0, 1500
            raws.append(raw(a["name"], b["name"], x, eff))
    return hosts, raws


def by_pair(links):
    return {(l["src"], l["dst"]): l for l in links}


def test_ceiling_formula():
    assert report.ceiling_mbit(1000, 1500) == pytest.approx(941.5, abs=0.1)
    assert report.ceiling_mbit(1000, 9000) == pytest.approx(990.0, abs=0.1)
    assert report.ceiling_mbit(None, 1500) is None


def test_assess_home_faults(home):
    hosts, raws = home
    links = by_pair(report.assess_links(hosts, raws))
    assert set(links) == {(a["name"], b["name"]) for a in hosts for b in hosts if a is not b}
    ml, lm = links[("macmini", "laptop")], links[("laptop", "macmini")]
    for l in (ml, lm):
        assert l["status"] == "down"
        assert {"mtu-mismatch", "mtu-blackhole"} <= set(l["warnings"])
        assert l["mtu_configured"] == 9000 and l["mtu_effective"] == 1500
    up = links[("jetson", "pi5")]
    assert up["status"] == "degraded" and "asymmetric" in up["warnings"] and "below-ceiling" in up["warnings"]
    assert "asymmetric" not in links[("pi5", "jetson")]["warnings"]
    ok = links[("pi5", "laptop")]
    assert ok["status"] == "ok" and ok["warnings"] == [] and ok["ceiling_mbit"] == pytest.approx(941.5, abs=0.1)
    # ceiling uses the smaller rated speed of the two ends
    assert links[("pi5", "macmini")]["ceiling_mbit"] == pytest.approx(941.5, abs=0.1)


def test_probe_limited_down_and_probe_failed():
    hosts = [host("a"), host("b"), host("c")]
    raws = [
        {
            "src": "a",
            "dst": "b",
            "rtt": dict(RTT),
            "pmtu": {"mtu_effective": 1500, "error": None},
            "tput": tput(600.0, cpu=True, method="builtin"),
        },
        {
            "src": "b",
            "dst": "a",
            "rtt_error": "no reply",
            "pmtu": {"mtu_effective": 1500, "error": None},
            "tput": tput(950.0),
        },
        {"src": "a", "dst": "c", "error": "host c: unreachable: 10.0.0.9:22"},
        {
            "src": "c",
            "dst": "a",
            "rtt": dict(RTT),
            "pmtu": {"mtu_effective": 1500, "error": None},
            "tput_error": "cannot connect to agent at 10.0.0.1:7650: Connection refused",
        },
        {"src": "b", "dst": "c", "rtt": dict(RTT), "pmtu": {"mtu_effective": 1500, "error": None}, "tput": tput(950.0)},
        {"src": "c", "dst": "b", "rtt": dict(RTT), "pmtu": {"mtu_effective": 1500, "error": None}, "tput": tput(950.0)},
    ]
    links = by_pair(report.assess_links(hosts, raws))
    ab = links[("a", "b")]
    assert ab["status"] == "degraded" and "probe-limited" in ab["warnings"] and ab["method"] == "builtin"
    assert "asymmetric" in ab["warnings"]  # 600 < 0.7 * 950
    ba = links[("b", "a")]
    assert ba["status"] == "degraded" and ba["warnings"] == ["probe-failed"] and "no reply" in ba["error"]
    ac = links[("a", "c")]
    assert ac["status"] == "down" and "unreachable" in ac["error"] and ac["throughput_mbit"] is None
    ca = links[("c", "a")]
    assert ca["status"] == "down" and "Connection refused" in ca["error"]
    assert links[("b", "c")]["status"] == "ok"


def test_report_validates_and_renders(home, tmp_path):
    hosts, raws = home
    links = report.assess_links(hosts, raws)
    doc = report.build_report(hosts, links, {"duration_s": 2.0, "backend": "auto"})
    assert report.validate_report(doc) == []
    written = report.write_report(doc, tmp_path / "out", str(tmp_path / "extra.json"))
    assert len(written) == 4
    back = json.loads((tmp_path / "out" / "links.json").read_text())
    assert back == json.loads((tmp_path / "extra.json").read_text()) and back["schema"] == "smolnet.links/1"
    md = (tmp_path / "out" / "links.md").read_text()
    assert "| **jetson** |" in md and "### Goodput" in md and "### Effective MTU" in md
    assert (
        "macmini <-> laptop: both ends are set to 9000 but the path carries 1500; large frames are "
        "dropped silently. Set the switch port to 9000 or both hosts to 1500."
    ) in md
    assert "jetson -> pi5 is the slow direction" in md
    png = (tmp_path / "out" / "links.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temp files left


def test_validate_catches_contract_breaks(home):
    hosts, raws = home
    good = report.build_report(hosts, report.assess_links(hosts, raws), {"duration_s": 1, "backend": "builtin"})
    cases = []
    d = copy.deepcopy(good)
    d["schema"] = "smolnet.links/0"
    cases.append(d)
    d = copy.deepcopy(good)
    d["links"].pop()
    cases.append(d)
    d = copy.deepcopy(good)
    d["links"][0]["status"] = "fine"
    cases.append(d)
    d = copy.deepcopy(good)
    d["links"][0]["rtt_us"] = {"min": 5, "p50": 4, "p90": 6, "p99": 7, "max": 8}
    cases.append(d)
    d = copy.deepcopy(good)
    d["links"][0]["warnings"] = ["made-up"]
    cases.append(d)
    d = copy.deepcopy(good)
    del d["links"][0]["ceiling_mbit"]
    cases.append(d)
    d = copy.deepcopy(good)
    d["links"][0]["mtu_effective"] = 70000
    cases.append(d)
    d = copy.deepcopy(good)
    d["hosts"][0].pop("iface")
    cases.append(d)
    for bad in cases:
        assert report.validate_report(bad), bad
    partial = copy.deepcopy(good)
    partial["links"] = partial["links"][:3]
    partial["incomplete"] = True
    assert report.validate_report(partial) == []


def test_incomplete_report_says_so(home, tmp_path):
    hosts, raws = home
    raws[0] = {"src": raws[0]["src"], "dst": raws[0]["dst"], "error": "not measured: the run was interrupted"}
    doc = report.build_report(
        hosts, report.assess_links(hosts, raws), {"duration_s": 1, "backend": "auto"}, incomplete=True
    )
    report.write_report(doc, tmp_path)
    assert json.loads((tmp_path / "links.json").read_text())["incomplete"] is True
    assert "incomplete" in (tmp_path / "links.md").read_text()
