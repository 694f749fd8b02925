"""The sim scenarios that check the plan off the CFS-quota path: `cores` (a cpuset each, no
quota) and `hidden` (a quota the host cannot read); and the shaped links' peak rate.

Every check is cheap: a half-second spin per host, all hosts at once, and a handful of
200 KB messages. Timings are only bounded on the side that load cannot cross: a busy
machine can slow a host below its cap, or a message below the link's rate, never above.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
from pathlib import Path

import pytest

from smolnet.errors import UsageError
from smolnet.sim import cgroup, net
from smolnet.sim import cluster as sim
from smolnet.sim.scenarios import HIDDEN_PERIOD_US, scenario, tcp_goodput_mbit

HIDDEN, HIDDEN_NET = "sc8", "10.66.8.0/24"
CORES, CORES_NET = "sc9", "10.66.9.0/24"

# What a host can tell about itself: the cap it reads, the CPU time it got over a spin of
# wall time, its CPUs, its machine identity.
LOOK = r"""
import json, os, time
from smolnet.sim.cgroup import own_quota
t0, c0 = time.perf_counter(), time.process_time()
while time.perf_counter() - t0 < 0.5:
    pass
share = (time.process_time() - c0) / (time.perf_counter() - t0)
cg = [ln for ln in open("/proc/self/cgroup").read().splitlines() if ln.split(":")[1] == "cpu"]
boot = open("/proc/sys/kernel/random/boot_id").read().strip()
print(json.dumps({"quota": own_quota(), "share": share, "cpus": sorted(os.sched_getaffinity(0)),
    "boot_id": boot, "cpu_cgroup": cg[0].split(":", 2)[2] if cg else None}))
"""


def _look(host) -> dict:
    from smolnet.remote import connect

    with connect(host) as r:
        return json.loads(r.run([host.python, "-c", LOOK], timeout=60, check=True).stdout)


def _look_all(inv_path: str) -> dict[str, dict]:
    from smolnet.inventory import load_inventory

    hosts = load_inventory(inv_path).hosts
    with cf.ThreadPoolExecutor(len(hosts)) as ex:
        return dict(zip([h.name for h in hosts], ex.map(_look, hosts)))


def _throttled(cg: str) -> int:
    stat = dict(ln.split() for ln in Path(cg, "cpu.stat").read_text().splitlines())
    return int(stat["nr_throttled"])


@pytest.mark.unit
def test_the_scenarios_say_what_each_host_owns():
    hidden = scenario("hidden")
    assert len(hidden) == 4 and all(h.cpu_hidden and h.own_machine for h in hidden)
    assert all(h.cpu_period_us == HIDDEN_PERIOD_US == 10_000 for h in hidden)
    caps = [h.cpu_cores for h in hidden]
    assert caps == sorted(caps) and sum(caps) <= 0.75 * os.cpu_count() + 1e-9
    assert all(300 <= h.up_mbit == h.down_mbit <= 800 for h in hidden)
    cores = scenario("cores")
    assert len(cores) == min(4, os.cpu_count())
    assert [h.cpuset for h in cores] == [str(i) for i in range(len(cores))]  # one CPU each, none shared
    assert all(h.cpu_cores is None and h.own_machine for h in cores)
    with pytest.raises(UsageError, match="one host per CPU"):
        scenario("cores", hosts=os.cpu_count() + 1)
    # 0.15 cores of a 10 ms period: 1.5 ms of quota, not the sim's own 2.5 ms / 16.7 ms
    assert cgroup.period_quota(0.15, 10_000) == (10_000, 1_500)


@pytest.mark.unit
def test_a_shaped_link_has_a_peak_rate():
    assert "peakrate" not in net.tbf_argv("eth0", 500, 1500)  # home, uniform, mtu-lab: the plain bucket
    assert all(h.link_peak for h in scenario("cores") + scenario("hidden"))
    argv = net.tbf_argv("eth0", 500, 1500, peak=True)
    kv = dict(zip(argv[7::2], argv[8::2]))
    # 500 Mbit is 62.5 MB/s: the 10 ms bucket holds 625,000 bytes and its queue twice that;
    # the peak is 1.1 x 500 = 550 Mbit, 16 frames of 1514 bytes (24,224) at a time
    assert kv == {
        "rate": "500mbit",
        "burst": "625000",
        "limit": "1250000",
        "peakrate": "550mbit",
        "minburst": "24224",
    }


def _up(tmp_path_factory, name: str, scenario: str, subnet: str, made: str):
    """A module's sim of `scenario`; after it is down, the cgroups it recorded under `made` are gone."""
    from need import need_cgroup, sim_up

    need_cgroup()
    sim.down(name)
    inv = str(tmp_path_factory.mktemp(scenario) / "sim.yml")
    st = sim_up(sim, name=name, scenario=scenario, subnet=subnet, inventory=inv)
    try:
        yield st
    finally:
        sim.down(name)
    assert not any(Path(h[made]).exists() for h in st["hosts"])


@pytest.fixture(scope="module")
def hidden(tmp_path_factory):
    yield from _up(tmp_path_factory, HIDDEN, "hidden", HIDDEN_NET, "cgroup")


@pytest.fixture(scope="module")
def cores(tmp_path_factory):
    yield from _up(tmp_path_factory, CORES, "cores", CORES_NET, "cpuset_cgroup")


def test_a_hidden_cap_holds_the_host_to_its_share_and_cannot_be_read(hidden):
    hosts = hidden["hosts"]
    for h in hosts:  # the truth, on the controller: the cap on the parent, none on the host's own group
        assert cgroup.quota(h["cgroup"]) == cgroup.period_quota(h["cpu_cores"], HIDDEN_PERIOD_US)[::-1]
        assert cgroup.quota(str(Path(h["cgroup"], cgroup.HIDDEN_CHILD))) is None
    before = {h["name"]: _throttled(h["cgroup"]) for h in hosts}
    seen = _look_all(hidden["inventory"])
    for h in hosts:
        s = seen[h["name"]]
        assert s["quota"] is None and s["cpu_cgroup"] == "/", s  # no cap on its path, no parent in sight
        # CPU time over wall: at most the cap (a 0.5 s spin is 50 periods), and the quota bit
        assert s["share"] <= h["cpu_cores"] * 1.15 + 0.02, (h["name"], s["share"])
        assert _throttled(h["cgroup"]) > before[h["name"]], h["name"]
    boots = {s["boot_id"] for s in seen.values()}
    assert len(boots) == len(hosts) and Path("/proc/sys/kernel/random/boot_id").read_text().strip() not in boots


def test_whole_core_hosts_run_on_a_cpu_each_without_a_quota(cores):
    seen = _look_all(cores["inventory"])
    for i, h in enumerate(cores["hosts"]):
        s = seen[h["name"]]
        assert s["cpus"] == [i] and s["quota"] is None, s
        assert Path(h["cpuset_cgroup"], "cpuset.cpus").read_text().strip() == str(i)
    assert len({s["boot_id"] for s in seen.values()}) == len(cores["hosts"])


SEND = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
data = b"x" * 200_000
out = []
for _ in range(6):
    time.sleep(0.03)  # idle, as between two collectives: a plain token bucket refills
    t0 = time.perf_counter()
    c.sendall(data)
    c.recv(1)
    out.append(time.perf_counter() - t0)
print(min(out[1:]))
"""

ECHO = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0))  # the host's own namespace: any free port
s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
while True:
    n = 0
    while n < 200_000:
        b = c.recv(1 << 20)
        if not b:
            sys.exit(0)
        n += len(b)
    c.sendall(b"k")
"""


def test_a_message_after_idle_crosses_no_faster_than_the_link(cores):
    """fsdp and tp send 100-300 KB per collective between compute stretches. Without a peak
    rate the idle link's bucket sent 200 KB over 500 Mbit in 0.8 ms; the wire takes 3.3."""
    import subprocess
    import sys

    if len(cores["hosts"]) < 2:
        pytest.skip("one CPU: the cores scenario has a single host")
    a, b = cores["hosts"][0], cores["hosts"][1]
    srv = subprocess.Popen(
        ["ip", "netns", "exec", b["netns"], sys.executable, "-c", ECHO, b["address"]],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = srv.stdout.readline().strip()
        r = subprocess.run(
            ["ip", "netns", "exec", a["netns"], sys.executable, "-c", SEND, b["address"], port],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
    finally:
        srv.kill()
        srv.wait()
    rate = min(a["up_mbit"], b["down_mbit"])
    wire_s = 200_000 * 8 / (tcp_goodput_mbit(rate, 1500) * 1e6)
    assert float(r.stdout) >= 0.8 * wire_s, (float(r.stdout), wire_s)
