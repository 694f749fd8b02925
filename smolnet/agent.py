"""The measurement agent: one per host, on `smol_agent_port` (TCP and UDP).

TCP connections prove the cluster secret first, then send one request frame:
  ping, facts                       -> a reply with this host's state
  throughput {dst, port, ...}       -> this agent sends to the agent at dst, replies with the
                                       receiver-side figure (built-in or iperf3)
  rtt {dst, port, count}            -> round trips to the agent at dst
  pmtu {dst, port}                  -> effective MTU towards dst (UDP probes, acked by dst)
  iperf3_server {lifetime}          -> starts a one-test iperf3 server, replies with its port
  sink_open / sink_data / echo      -> the far end of the above
UDP datagrams on the same port are MTU probes; only authenticated ones get an ack.

The controller only ever sends control messages; test traffic flows agent to agent,
over the hosts' own link. A peer that misbehaves loses its connection, never the agent.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from smolnet import agent_client as control
from smolnet import facts, wire
from smolnet.probes import iperf, pmtu, rtt, throughput
from smolnet.server import PREAUTH_TIMEOUT, AuthListener, shut

log = logging.getLogger("smolnet.agent")

MAX_CONNECTIONS = 64
HANDSHAKE_TIMEOUT = 5.0
REQUEST_TIMEOUT = 10.0
VERSION = 2  # 2: every frame MACed (agent_client.Conn)
OPS = ("ping", "facts", "echo", "sink_open", "sink_data", "iperf3_server", "throughput", "rtt", "pmtu", "lease")
# requests only a controller makes: they renew a lease (agent-to-agent traffic does not)
RENEWS = ("ping", "facts", "iperf3_server", "throughput", "rtt", "pmtu", "lease")


def _bind_pair(bind: str, port: int, tries: int = 20) -> tuple[socket.socket, socket.socket]:
    """A TCP and a UDP socket on one port. Port 0 lets the kernel pick TCP's, and another
    process may hold that number for UDP: pick again rather than fail (a loopback test suite
    starts hundreds of agents)."""
    attempts = tries if port == 0 else 1
    for attempt in range(attempts):
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            tcp.bind((bind, port))
            udp.bind((bind, tcp.getsockname()[1]))
            return tcp, udp
        except OSError:
            tcp.close()
            udp.close()
            if attempt + 1 == attempts:
                raise


class Agent:
    def __init__(
        self,
        bind: str,
        port: int,
        secret: bytes,
        iface: str | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        request_timeout: float = REQUEST_TIMEOUT,
        lease: float | None = None,
    ):
        # lease: stop when no controller request came for this long (an agent started for one
        # matrix must not outlive a controller or a host link that dropped mid-run)
        self.lease = lease
        self.renewed = time.monotonic()
        self.handshake_timeout = handshake_timeout
        self.request_timeout = request_timeout
        self.bind = bind
        self.port = port
        self.secret = secret
        self.iface = iface
        self.sinks = throughput.SinkRegistry()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.stopping = threading.Event()
        self.life = threading.RLock()  # serve_forever's setup and stop() one at a time
        self.listener: AuthListener | None = None
        self.started = time.time()
        self.ops: dict[str, int] = {}
        self.stats = {"accepted": 0, "rejected": 0, "errors": 0, "forged": 0, "udp_acked": 0, "udp_dropped": 0}
        self.tcp, self.udp = _bind_pair(bind, port)
        self.port = self.tcp.getsockname()[1]
        self.tcp.listen(128)
        self.udp.settimeout(0.5)  # the UDP loop polls `stopping`

    # -- lifecycle ---------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Handshakes run concurrently in AuthListener (strangers capped and evicted); at most
        MAX_CONNECTIONS authenticated requests at once, the rest are told the agent is busy."""
        with self.life:  # a stop() that came first leaves nothing to serve (its sockets are closed)
            if self.stopping.is_set():
                return
            threading.Thread(target=self._udp_loop, name="udp", daemon=True).start()
            self.listener = AuthListener(
                self.tcp,
                self.secret,
                self._authenticated,
                name="agent",
                preauth_timeout=min(self.handshake_timeout, PREAUTH_TIMEOUT),
                stats=self.stats,
                with_key=True,
            )
            self.listener.start()
        while not self.stopping.wait(0.2 if self.lease else None):
            if self.lease and time.monotonic() - self.renewed > self.lease:
                log.warning("lease of %gs lapsed without word from a controller: stopping", self.lease)
                self.stop()

    def _authenticated(self, sock: socket.socket, peer, key: bytes) -> None:
        conn = control.Conn(sock, key, client=False)
        if not self.slots.acquire(blocking=False):
            self.stats["busy"] += 1
            log.warning("%s:%d turned away: %d requests already running", peer[0], peer[1], MAX_CONNECTIONS)
            self._error(conn, f"busy: {MAX_CONNECTIONS} requests already running; try again")
            conn.close()
            return
        self._handle(conn, peer)

    def start_background(self) -> threading.Thread:
        t = threading.Thread(target=self.serve_forever, name="agent", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        with self.life:
            self.stopping.set()
            if self.listener is not None:
                self.listener.close()
            for s in (self.tcp, self.udp):  # the UDP loop woken: an agent started at once finds the port free
                shut(s, close=True)

    # -- UDP: MTU probe acks -----------------------------------------------------------
    def _udp_loop(self) -> None:
        buf = bytearray(65536)
        view = memoryview(buf)
        while not self.stopping.is_set():
            try:
                n, peer = self.udp.recvfrom_into(view)
            except TimeoutError:
                continue
            except OSError:
                if self.stopping.is_set():
                    return
                continue
            try:
                ack = pmtu.answer_probe(self.secret, view[:n])
                if ack is None:
                    self.stats["udp_dropped"] += 1
                    continue
                self.udp.sendto(ack, peer)
                self.stats["udp_acked"] += 1
            except Exception as e:  # never let one datagram end the loop
                log.warning("udp from %s: %s", peer, e)

    # -- TCP: one request per connection ---------------------------------------------------
    def _handle(self, conn: control.Conn, peer) -> None:
        who = f"{peer[0]}:{peer[1]}"
        try:
            kind, meta, _ = conn.recv(self.request_timeout)
            if kind != control.KIND_REQUEST:
                raise wire.WireError(f"expected a request frame, got kind {kind}")
            self._dispatch(conn, meta)
        except wire.AuthError as e:
            self.stats["rejected"] += 1
            log.warning("%s rejected: %s", who, e)
        except wire.ForgedFrame as e:  # injected into the stream after the handshake: never acted on
            self.stats["forged"] += 1
            log.warning("%s: frame dropped, connection closed: %s", who, e)
        except (wire.WireError, TimeoutError, ValueError) as e:
            self.stats["errors"] += 1
            log.warning("%s dropped: %s", who, e)
            self._error(conn, str(e))
        except OSError as e:
            self.stats["errors"] += 1
            log.warning("%s dropped: %s", who, e)
        except Exception as e:  # a bug must cost one connection, not the agent
            self.stats["errors"] += 1
            log.exception("%s: internal error: %s", who, e)
            self._error(conn, f"internal error: {e}")
        finally:
            try:
                conn.close()
            finally:
                self.slots.release()

    def _error(self, conn: control.Conn, msg: str) -> None:
        try:
            conn.send(control.KIND_ERROR, {"error": msg[:500]}, timeout=2.0)
        except Exception:
            pass

    def _reply(self, conn: control.Conn, meta: dict) -> None:
        conn.send(control.KIND_REPLY, meta, timeout=REQUEST_TIMEOUT)

    def _dispatch(self, conn: control.Conn, req: dict) -> None:
        op = req.get("op")
        if isinstance(op, str) and op in OPS:
            self.ops[op] = self.ops.get(op, 0) + 1
        if op in RENEWS:
            self.renewed = time.monotonic()
        if op == "ping":
            self._reply(
                conn,
                {
                    "ok": True,
                    "version": VERSION,
                    "hostname": socket.gethostname(),
                    "bind": self.bind,
                    "port": self.port,
                    "iperf3": iperf.available(),
                    "uptime_s": round(time.time() - self.started, 1),
                },
            )
        elif op == "facts":
            iface = req.get("iface") if isinstance(req.get("iface"), str) else None
            self._reply(conn, facts.collect_facts(self.bind, iface or self.iface))
        elif op == "echo":
            rtt.serve_echo(conn.sock, req)
        elif op == "sink_open":
            s = self.sinks.open(req)
            try:
                self._reply(conn, {"session": s.id})
                result = s.measure()
            finally:
                self.sinks.close(s)
            self._reply(conn, result)
        elif op == "sink_data":
            throughput.serve_sink_data(conn.sock, req, self.sinks)
        elif op == "iperf3_server":
            lifetime = min(max(float(req.get("lifetime", 60)), 1.0), 300.0)
            try:
                port, _ = iperf.start_server(self.bind, lifetime)
            except iperf.IperfError as e:
                raise ValueError(str(e)) from None
            self._reply(conn, {"port": port})
        elif op == "lease":
            self._reply(conn, {"ok": True, "lease_s": self.lease})
        elif op in ("throughput", "rtt", "pmtu"):
            self._reply(conn, self._probe(op, req))
        else:
            raise wire.WireError(f"unknown op {str(op)[:40]!r}")

    def _probe(self, op: str, req: dict) -> dict:
        """Probes this agent runs towards another agent, on behalf of the controller."""
        dst = str(req.get("dst", ""))
        try:
            socket.inet_aton(dst)
        except OSError:
            raise ValueError(f"dst {dst[:40]!r} is not an IPv4 address") from None
        port = int(req.get("port", 0))
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} outside 1..65535")
        try:
            if op == "rtt":
                return rtt.measure_rtt(dst, port, self.secret, count=int(req.get("count", 300)), source=self.bind)
            if op == "pmtu":
                return pmtu.measure_pmtu(dst, port, self.secret, source=self.bind)
            # bounded here for both backends: iperf3 would run whatever it is given
            duration = throughput._bounded(req.get("duration", 3.0), 0.1, throughput.MAX_DURATION, "duration")
            omit = throughput._bounded(req.get("omit", 1.0), 0, throughput.MAX_OMIT, "omit")
            streams = int(throughput._bounded(req.get("streams", 4), 1, throughput.MAX_STREAMS, "streams"))
            if req.get("backend") == "iperf3":
                return iperf.run_client(dst, port, duration, omit, streams, source=self.bind)
            return throughput.send_builtin(dst, port, self.secret, duration, omit, streams, source=self.bind)
        except (control.AgentError, iperf.IperfError) as e:
            raise ValueError(str(e)) from None
        except OSError as e:
            raise ValueError(f"{op} to {dst}:{port}: {e.strerror or e}") from None
