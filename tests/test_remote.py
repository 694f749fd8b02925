"""Remote execution: the SSH path against a real sim host, the local path, and every
error naming the host and its cause (refused, auth failed, unreachable, timed out)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from need import need_sim

from smolnet.inventory import Host, load_inventory
from smolnet.remote import LocalRemote, RemoteError, connect
from smolnet.sim import cluster as sim


@pytest.fixture(scope="module")
def simhost(tmp_path_factory):
    """One unshaped sim host (sim tr, 10.213.55.0/24) reached over SSH."""
    need_sim()
    inv = tmp_path_factory.mktemp("tr") / "sim.yml"
    sim.down("tr")
    sim.up(name="tr", scenario="uniform", hosts=1, rate_mbit=0, subnet="10.213.55.0/24", inventory=str(inv))
    try:
        yield load_inventory(inv).hosts[0]
    finally:
        sim.down("tr")


def _variant(h: Host, **kw) -> Host:
    d = h.to_dict()
    d.update(kw)
    return Host(**d)


# --- SSH against the sim ------------------------------------------------------------------


def test_ssh_run_start_stop_put(simhost):
    with connect(simhost) as r:
        res = r.run(["sh", "-c", "cat; echo err >&2; exit 3"], stdin=b"hello", timeout=15)
        assert (res.rc, res.stdout, res.stderr) == (3, "hello", "err\n")
        with pytest.raises(RemoteError, match=r"^node1: .*exited 3"):
            r.run("exit 3", timeout=15, check=True)
        p = r.start(["sleep", "60"], log="/root/sleep.log")
        assert p.pid > 1 and r.alive(p)
        r.stop(p)
        assert not r.alive(p)
        r.put_file("/root/smol/put.txt", b"abc\n", mode=0o640)
        assert r.run("stat -c %a /root/smol/put.txt; cat /root/smol/put.txt", timeout=15).stdout == "640\nabc\n"
    assert not Path("/root/smol/put.txt").exists()  # it went into the host's own /root


def test_ssh_command_timeout(simhost):
    with connect(simhost) as r:
        t = time.monotonic()
        with pytest.raises(RemoteError, match=r"^node1: timed out after 1s"):
            r.run(["sleep", "10"], timeout=1)
        assert time.monotonic() - t < 8


def test_wrong_key_is_auth_failed(simhost, tmp_path):
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = tmp_path / "other_key"
    key.write_bytes(
        Ed25519PrivateKey.generate().private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption())
    )
    key.chmod(0o600)
    with pytest.raises(RemoteError, match=r"^node1: auth failed for root@10\.213\.55\.1:22"):
        connect(_variant(simhost, key_file=str(key)))


def test_unknown_host_key_is_refused(simhost, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(RemoteError, match="unknown host key"):
        connect(_variant(simhost, known_hosts_file=str(empty)))


def test_refused_port(simhost):
    with pytest.raises(RemoteError, match=r"^node1: connection refused by 10\.213\.55\.1:2222"):
        connect(_variant(simhost, port=2222), timeout=5)


def test_unreachable_address(simhost):
    """An address on the sim switch that nobody answers ARP for."""
    with pytest.raises(RemoteError, match=r"^ghost: (unreachable|timed out connecting)"):
        connect(_variant(simhost, name="ghost", address="10.213.55.99"), timeout=8)


def test_connect_timeout():
    """A listener whose accept queue is full drops our SYN: the connect must time out."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    try:
        for _ in range(2):
            c = socket.socket()
            c.settimeout(0.3)
            try:
                c.connect(("127.0.0.1", port))
            except OSError:
                pass
            fillers.append(c)
        h = Host(name="slow", address="127.0.0.1", cluster_ip="127.0.0.1", port=port)
        t = time.monotonic()
        with pytest.raises(RemoteError, match=r"^slow: timed out connecting to 127\.0\.0\.1"):
            connect(h, timeout=1.0)
        assert time.monotonic() - t < 10
    finally:
        for c in fillers:
            c.close()
        srv.close()


# --- the local path -----------------------------------------------------------------------


def _local() -> LocalRemote:
    r = connect(Host(name="here", address="127.0.0.1", cluster_ip="127.0.0.1", local=True))
    assert isinstance(r, LocalRemote)
    return r


def test_local_run_and_errors():
    r = _local()
    assert r.run(["echo", "a b"]).stdout == "a b\n"
    assert r.run("cat; exit 4", stdin=b"x").rc == 4
    with pytest.raises(RemoteError, match=r"^here: .*exited 4"):
        r.run("exit 4", check=True)
    with pytest.raises(RemoteError, match=r"^here: command not found"):
        r.run(["/nonexistent/smol-tool"])
    with pytest.raises(RemoteError, match=r"^here: timed out after 0.5s"):
        r.run(["sleep", "5"], timeout=0.5)


def test_local_start_stop_put(tmp_path):
    r = _local()
    log = tmp_path / "out.log"
    p = r.start(["sh", "-c", "cat; echo done; sleep 60"], stdin=b"fed\n", log=str(log))
    assert r.alive(p)
    deadline = time.monotonic() + 5
    while "done" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.read_text() == "fed\ndone\n"
    r.stop(p)
    assert not r.alive(p)
    target = tmp_path / "sub" / "f.bin"
    r.put_file(str(target), b"\x00\x01", mode=0o600)
    assert target.read_bytes() == b"\x00\x01" and target.stat().st_mode & 0o777 == 0o600
    assert not list(target.parent.glob("*.smoltmp"))
