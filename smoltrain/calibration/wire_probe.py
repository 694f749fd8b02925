"""What a message costs each host's CPU on the interface the ranks really use.

comm_probe.comm_cpu times a ring of three ranks on one host's loopback. On the sim's home hosts
a decode rank spends 1.6-2x that CPU per ring step (tp, 96 a token) and about 4x per pp
hop (issue 36: `generate --json` decode.per_rank): a message to another host also crosses
a veth, the bridge and the shapers, the peer's wake-up is a real one, and a capped host
runs it on a cold cache after idling. So calibrate also runs one ring of every measured
host over the cluster's own addresses: each host all-reduces a small and a large tensor
with its real peers and counts its own CPU seconds, at its own pace (a capped host's CPU
second is 1/cap seconds of wall time). Its per-message figure replaces the loopback one in
the compute report (which stays whole as `comm_cpu_loopback`); bytes/s, a CPU's copy rate,
stays the loopback figure.

`python -m smoltrain.calibration.wire_probe --rank R --world N --addrs A,B,.. --port P`
is one rank (the group's secret on stdin); `measure(hosts)` runs a rank on every host.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import secrets
import sys
import time

SMALL = 96  # floats all-reduced: a small model's hidden state, a few hundred bytes
# seconds per timed loop (rank 0 decides); thirty periods of the sim's slowest host. The one window,
# --quick too: at 0.25 s the home sim's four hosts read 1.2-1.7x the message cost of 0.5 s, every
# host in two calibrations (2026-12-07), for 0.3 s saved a calibrate
WINDOW = 0.5
TIMEOUT = 120.0


def _layer(torch):
    """A decode layer's small work at hidden size 96 (a norm, two products, an activation): what
    a tp rank runs between its all-reduces, so each message waits on a peer that was busy."""
    g = torch.Generator().manual_seed(0)
    w1, w2, x = torch.randn(96, 96, generator=g), torch.randn(96, 96, generator=g), torch.randn(1, 96, generator=g)

    def layer():
        return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (96,)) @ w1) @ w2

    return layer


def rank_main(rank: int, addrs: list[str], port: int, secret: bytes, window: float = WINDOW) -> dict:
    """One rank of the ring: this host's CPU seconds per message (one ring step: one sent, one
    received) as a decode rank spends them, at its pace: each all-reduce follows a layer's
    work, and the same work timed alone is taken off (a tight loop of all-reduces finds its
    peer's message waiting and never sleeps: 76 us a step on loopback where the ranks of a tp
    decode spend 107-111). Small messages only: a hidden state, below any MTU, so a path whose
    MTU is wrong (provisioning finds and fixes it) still answers."""
    import torch

    from smoltrain.calibration.comm_probe import ring_rounds
    from smoltrain.calibration.pace import cpu_pace
    from smoltrain.comm import make_comm

    torch.set_num_threads(1)
    pace = cpu_pace()
    layer = _layer(torch)
    c = make_comm("socket", rank, len(addrs), addrs[0], port, secret, timeout=60.0, addrs=addrs)
    try:
        t = torch.zeros(SMALL)
        ring_rounds(c, t, rank, window / 4, layer, time.process_time)  # warm-up: first messages, buffers, caches
        cpu, n = ring_rounds(c, t, rank, window, layer, time.process_time)
    finally:
        c.close()
    c0 = time.process_time()
    for _ in range(n):
        layer()
    alone = time.process_time() - c0
    return {"message_s": max(0.0, cpu - alone) / n / (2 * (len(addrs) - 1)) * pace}


def argv_for(h, rank: int, addrs: list[str], port: int) -> list[str]:
    """The rank, started through the host's warm server (smolnet.warm) that the probe left
    running: torch is imported there already (about 1.4 s of CPU a host otherwise)."""
    from smolnet import warm
    from smoltrain.run import WORKER_IMPORTS

    return warm.command(h.python, WORKER_IMPORTS, "smoltrain.calibration.wire_probe", "--rank", str(rank)) + [
        "--addrs",
        ",".join(addrs),
        "--port",
        str(port),
        "--window",
        f"{WINDOW:g}",
    ]


def measure(hosts: list, timeout: float = TIMEOUT, port: int | None = None) -> dict[str, dict]:
    """{host name: {"message_s": ...}} from one ring over `hosts` (each reached as inventory.Host, over
    its `cluster_ip`); {} when there are fewer than two, and RemoteError/ValueError when a rank
    fails (calibrate then keeps the loopback figures)."""
    from smolnet.remote import RemoteError, connect

    if len(hosts) < 2:
        return {}
    addrs = [h.cluster_ip or h.address for h in hosts]  # where the ranks' traffic goes
    # each host has its own ports; a clash fails the ring (the loopback figures stay), not a host
    port = port or random.randrange(21000, 29000)
    secret = secrets.token_bytes(32)

    def one(rank: int) -> dict:
        h = hosts[rank]
        with connect(h) as r:
            res = r.run(argv_for(h, rank, addrs, port), timeout=timeout, stdin=secret)
        if res.rc != 0:
            lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
            raise RemoteError(h.name, lines[-1] if lines else f"wire probe exited {res.rc}")
        return json.loads(res.stdout.strip().splitlines()[-1])

    with cf.ThreadPoolExecutor(len(hosts)) as ex:
        got = list(ex.map(one, range(len(hosts))))
    return {h.name: g for h, g in zip(hosts, got)}


def apply(hosts: list, doc: dict, say=None, port: int | None = None) -> None:
    """Put the ring's figures in the compute report `doc` as each host's comm_cpu (the loopback
    ones kept as comm_cpu_loopback); a failed ring leaves them, with one line saying why."""
    say = say or (lambda name, what: None)
    entries = {d.get("name"): d for d in doc.get("hosts", [])}
    ok = [h for h in hosts if (entries.get(h.name) or {}).get("comm_cpu") and not entries[h.name].get("error")]
    if len(ok) < 2:
        return
    try:
        got = measure(ok, port=port)
    except Exception as e:  # the loopback figures still stand
        say(ok[0].name, f"messages between the hosts not measured ({e}); loopback figures kept")
        return
    for name, cc in got.items():
        e = entries[name]
        e["comm_cpu_loopback"] = e["comm_cpu"]
        e["comm_cpu"] = dict(e["comm_cpu"], **cc)  # bytes/s stays the loopback figure: the CPU's, not the wire's
        say(name, f"{cc['message_s'] * 1e6:,.0f} us a message between the hosts, at its pace")
    doc.setdefault("settings", {})["comm_cpu"] = "a ring over the hosts' own addresses (wire_probe)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="smoltrain.calibration.wire_probe")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--addrs", required=True, help="every rank's address, in rank order, comma-separated")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--window", type=float, default=WINDOW)
    a = p.parse_args(argv)
    addrs = [x for x in a.addrs.split(",") if x]
    secret = sys.stdin.buffer.read(32)
    if len(addrs) < 2 or not 0 <= a.rank < len(addrs) or len(secret) != 32:
        print("wire_probe: need 2+ addresses, a rank among them and a 32-byte secret on stdin", file=sys.stderr)
        return 2
    print(json.dumps(rank_main(a.rank, addrs, a.port, secret, a.window)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
