"""Who is in the group at each outer step: diloco's membership, kept by rank 0.

The ranks all-reduce among themselves (a ring over a rank mesh), but a mesh cannot lose
or gain a member, so membership is decided here, once per outer step, and the mesh is
rebuilt when it changes. Rank 0 runs a `Roster` thread; every member, rank 0's own
included, holds a `Member` connection to it (authenticated, smolnet.wire frames). An outer
step is two rounds on it:

  sync:    each member sends CHECKIN {outer, tokens}; when all are in (or a member's
           connection broke, or it is `barrier_timeout` behind the first), the roster
           drops the missing (`leave`), admits whoever connected since (`join`), and
           answers every member ROSTER {epoch, names, ranges, tokens}: the group for
           this all-reduce (a new epoch when it changed), each one's slice of the
           batch, and the tokens the pseudo-gradients are averaged over; under
           `--placement auto` also `paced`: the sequences each member trains in the next
           outer step, from the pace (tokens per second of inner steps) each one showed
           so far, so a host faster or slower than its calibration stops keeping the
           others waiting (planner.placement.paced_ranges lays them over the steps);
  commit:  after the all-reduce each member sends CHECKIN {ok}; the answer is ok only
           if every member of the round succeeded. Otherwise (a member died mid-ring)
           everyone goes back to sync with what it holds and the step is redone, so no
           rank applies an outer step another rank did not.

Between rounds a member all-reduces over its `Ring`, rebuilt whenever the epoch changes (a
newcomer then gets the anchor and outer momentum from rank 0 and trains from the next step)
or an attempt failed; each build rendezvouses under the sync round's own name, so a member
that rebuilds before rank 0 cannot meet the previous ring's rendezvous (torch backend).
Under `--placement auto` a member trains floor(n/H) or one more sequences of each inner step,
n its sequences for the outer step (`slices`). The first outer step has no measured pace yet:
every member lays it out alike from the plan's (planner.pacing.placed_paces: the placement's
sequences per step over the compute the plan gave each rank for them; the plan predicts that
split), since the placement's whole sequences per step can leave one host well behind the
others (bench_finetune_home run 6: the laptop's 5 of 8 sequences took 5.9 s, the Jetson's 1
took 4.2 s; at H=36 the laptop came 80 s after the first and was dropped as late).

The wait in the sync round is each rank's wait at the sync (the run report's outer
steps). Nothing here waits without a deadline, except for the first arrival of a round
(the members are computing their inner steps) and rank 0's own check-in. A member that
checked in hears WAIT every few seconds while the roster still waits for others, so a slow
rank 0 (a Jetson holding the roster, long outer steps at a large H) keeps its group instead
of running the members past their timeout; a roster that goes silent still times them out.
A member is late when it is more than `barrier_timeout` behind the first, or half the
first's time for the round, whichever is longer: at a large H a fraction of an outer step
is minutes, and a host 25% off its calibration is not a straggler.
"""

from __future__ import annotations

import select
import socket
import threading
import time

from smolnet import wire
from smolnet.server import AuthListener
from smoltrain.comm import CommError, make_comm
from smoltrain.planner.pacing import paced_counts
from smoltrain.planner.placement import named_batch_ranges, paced_ranges
from smoltrain.strategies.parameter_server import close_all

HELLO, CHECKIN, ROSTER, VERDICT, STOP, WAIT = 21, 22, 23, 24, 25, 26


def member_timeout(run) -> float:
    """How long a member waits for the roster to answer (or to say WAIT)."""
    return 2 * run.barrier_timeout + run.timeout


def roster_port(run) -> int:
    """The group's spare port (comm.group.ports_needed leaves one after the ranks' ports)."""
    return run.port + run.world_size + 1


class _Conn:
    def __init__(self, name: str, order: int, addr: str, sock: socket.socket, session: wire.Session):
        self.name, self.order, self.addr, self.sock, self.session = name, order, addr, sock, session


class Roster:
    """Rank 0's membership thread (see the module docstring)."""

    def __init__(self, ctx, expected: int, last_outer: int, start_timeout: float = 60.0):
        run = ctx.run
        self.ctx, self.expected, self.last_outer = ctx, expected, last_outer
        self.barrier_timeout, self.start_timeout = run.barrier_timeout, start_timeout
        self.keepalive_s = min(5.0, member_timeout(run) / 4)  # WAIT this often to members that are in
        self.round_start = time.monotonic()  # when the members started toward this round
        self.placement = run.placement or (
            {"order": list(run.names), "shares": list(run.shares)} if run.shares else None
        )
        # re-balanced at every outer step from the measured pace (--placement auto only: an
        # even or hand-given split stays as given, and the run reproduces bit for bit)
        self.paced = bool(run.placement and run.placement.get("mode") == "auto")
        self.pace: dict[str, float] = {}  # member -> tokens per second of its inner steps
        self.members: list[_Conn] = []
        self.pending: list[_Conn] = []
        self.lock = threading.Lock()
        self.epoch, self.rounds, self.error, self.stopping = 0, 0, None, False
        self.listener = AuthListener.serve(
            run.coord_addr, roster_port(run), ctx.secret, self._greet, name="roster", with_key=True
        )
        self.thread = threading.Thread(target=self._serve, name="roster", daemon=True)
        self.thread.start()

    def _greet(self, sock: socket.socket, addr, key: bytes) -> None:
        ses = wire.Session(key, client=False)
        try:
            kind, meta, _ = wire.recv_frame(sock, timeout=10.0, max_payload=0, session=ses)
            if kind != HELLO or not isinstance(meta.get("name"), str):
                raise wire.WireError("first frame is not a HELLO")
            with self.lock:
                where = str(meta.get("addr") or addr[0])  # where its peers reach it: the address it came from
                self.pending.append(_Conn(meta["name"], int(meta.get("order", 1 << 30)), where, sock, ses))
        except (OSError, wire.WireError, TimeoutError, ValueError) as e:
            self.ctx.reporter.log(f"roster: refused {addr[0]}: {e}")
            sock.close()

    def _step_of(self, outer: int) -> int:
        return min((outer + 1) * self.ctx.run.inner_steps, self.ctx.run.steps) - 1

    def _drop(self, m: _Conn, outer: int, why: str) -> None:
        self.ctx.reporter.log(f"roster: dropping {m.name} at outer step {outer}: {why}")
        self.ctx.reporter.event(self._step_of(outer), "leave", m.name)
        m.sock.close()
        if m in self.members:
            self.members.remove(m)

    def _round(self) -> tuple[dict, list]:
        """CHECKIN from every member: ({conn: meta}, [(conn, why) of those dropped])."""
        got: dict[_Conn, dict] = {}
        lost: list = []
        first = allow = None
        pinged = time.monotonic()
        while len(got) < len(self.members) and not self.stopping:
            waiting = [m for m in self.members if m not in got]
            if got and time.monotonic() - pinged > self.keepalive_s:
                pinged = time.monotonic()
                for m in list(got):
                    try:
                        wire.send_frame(m.sock, WAIT, {}, timeout=10.0, session=m.session)
                    except (OSError, wire.WireError, TimeoutError) as e:
                        lost.append((m, f"connection lost ({e})"))
                        self.members.remove(m)
                        del got[m]
            left = None if first is None else first + allow - time.monotonic()
            if left is not None and left <= 0 and any(m.order for m in waiting):
                # late members are dropped; rank 0's own is waited for (without it there is no run)
                late = [m for m in waiting if m.order]
                lost += [(m, f"more than {allow:.3g}s behind the first at the sync") for m in late]
                for m in late:
                    self.members.remove(m)
                continue
            ready, _, _ = select.select([m.sock for m in waiting], [], [], min(0.5, left) if left and left > 0 else 0.5)
            for m in [m for m in waiting if m.sock in ready]:
                try:
                    kind, meta, _ = wire.recv_frame(m.sock, timeout=10.0, max_payload=0, session=m.session)
                    if kind != CHECKIN:
                        raise wire.WireError(f"expected a CHECKIN, got frame {kind}")
                except (OSError, wire.WireError, TimeoutError) as e:
                    lost.append((m, f"connection lost ({e})"))
                    self.members.remove(m)
                    continue
                got[m] = meta
                if first is None:
                    first = time.monotonic()
                    allow = max(self.barrier_timeout, 0.5 * (first - self.round_start))
        for m, _ in lost:
            if m in self.members:
                self.members.remove(m)
        self.round_start = time.monotonic()
        return got, lost

    def _send(self, m: _Conn, kind: int, meta: dict, outer: int) -> None:
        try:
            wire.send_frame(m.sock, kind, meta, timeout=10.0, session=m.session)
        except (OSError, wire.WireError, TimeoutError) as e:
            self._drop(m, outer, f"cannot answer it ({e})")

    def _sync(self, outer: int, got: dict) -> None:
        names = [m.name for m in self.members]
        with self.lock:
            new, self.pending = self.pending, []
        for m in sorted(new, key=lambda c: (c.order, c.name)):
            self.members.append(m)
            self.ctx.reporter.event(self._step_of(outer) + 1, "join", m.name)
        if [m.name for m in self.members] != names:
            self.epoch += 1
        now = [m.name for m in self.members]
        ranges = named_batch_ranges(self.ctx.batch, now, self.placement)
        tokens = sum(int(got[m].get("tokens", 0)) for m in self.members if m in got)
        paced = self._paced(outer, got, now)
        meta = {
            "outer": outer,
            "epoch": self.epoch,
            "names": now,
            "addrs": [m.addr for m in self.members],
            "ranges": {n: list(r) for n, r in ranges.items()},
            "tokens": tokens,
            "joined": [m.name for m in new],
        }
        if paced:
            meta["paced"] = paced
        self.rounds += 1  # a ring built in this round keys its rendezvous by it (comm.torch_comm)
        meta["round"] = self.rounds
        for m in list(self.members):
            self._send(m, ROSTER, meta, outer)

    def _paced(self, outer: int, got: dict, now: list[str]) -> dict | None:
        """The next outer step's sequences per member, in proportion to the pace each showed
        in the last outer step it trained in (paced_counts). None where a member has no pace
        yet (a newcomer: then the placement's shares, renormalised, for one outer step)."""
        if not self.paced:
            return None
        for m, meta in got.items():
            secs, toks = float(meta.get("seconds") or 0.0), int(meta.get("tokens") or 0)
            if secs > 0 and toks > 0:  # the latest: a pace depends on the share it was measured at
                self.pace[m.name] = toks / secs
        steps = self._step_of(outer + 1) - self._step_of(outer)  # of the next outer step
        return paced_counts(self.pace, now, steps, self.ctx.batch)

    def _serve(self) -> None:
        try:
            deadline = time.monotonic() + self.start_timeout

            def starters():  # the run's own ranks; a joiner that came early waits for the first sync
                return [c for c in self.pending if c.order < self.expected]

            while len(starters()) < self.expected:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {len(starters())} of {self.expected} members connected")
                time.sleep(0.02)
            with self.lock:
                self.members = sorted(starters(), key=lambda c: (c.order, c.name))
                self.pending = [c for c in self.pending if c not in self.members]
            self.round_start = time.monotonic()
            while not self.stopping:
                before = len(self.members)
                got, lost = self._round()
                if not got:
                    raise RuntimeError("every member has left")
                first = next(iter(got.values()))
                outer = int(first.get("outer", 0))
                for m, why in lost:
                    self._drop(m, outer, why)
                if first.get("phase") == "sync":
                    self._sync(outer, got)
                    continue
                ok = len(got) == before == len(self.members) and all(meta.get("ok") for meta in got.values())
                for m in list(self.members):
                    self._send(m, VERDICT, {"outer": outer, "ok": ok}, outer)
                if ok and outer >= self.last_outer:
                    break
        except BaseException as e:  # the run fails on rank 0's side with this reason
            self.error = e
            self.ctx.reporter.log(f"roster failed: {e}")
        finally:
            self.close()

    def close(self) -> None:
        self.stopping = True
        with self.lock:
            pending, self.pending = self.pending, []
        for m in pending:  # joiners too late for the last outer step
            try:
                wire.send_frame(m.sock, STOP, {}, timeout=2.0, session=m.session)
            except (OSError, wire.WireError, TimeoutError):
                pass
        close_all(self.listener, self.members + pending)


class Member:
    """A rank's connection to the roster."""

    def __init__(self, run, secret: bytes, name: str, order: int, timeout: float):
        self.timeout = timeout
        self.sock, key = wire.connect(
            run.coord_addr, roster_port(run), secret, timeout=timeout, what="roster", keyed=True
        )
        self.session = wire.Session(key, client=True)
        addr = self.sock.getsockname()[0]  # the address this rank reached rank 0 from: its peers can reach it there
        wire.send_frame(
            self.sock, HELLO, {"name": name, "order": order, "addr": addr}, timeout=10.0, session=self.session
        )

    def _ask(self, meta: dict, want: int, timeout: float | None) -> dict | None:
        if meta is not None:
            wire.send_frame(self.sock, CHECKIN, meta, timeout=10.0, session=self.session)
        kind = WAIT
        while kind == WAIT:  # the roster is still waiting for others: each WAIT restarts the timeout
            kind, got, _ = wire.recv_frame(self.sock, timeout=timeout, max_payload=0, session=self.session)
        if kind == STOP:
            return None
        if kind != want:
            raise wire.WireError(f"roster sent frame {kind}, expected {want}")
        return got

    def sync(self, outer: int, tokens: int, seconds: float) -> dict:
        """This outer step's group: {epoch, names, ranges, tokens, joined[, paced]}; `seconds`:
        the inner steps' compute time behind `tokens`, the member's pace."""
        meta = {"outer": outer, "phase": "sync", "tokens": tokens, "seconds": seconds}
        return self._ask(meta, ROSTER, self.timeout)

    def commit(self, outer: int, ok: bool) -> bool:
        return bool(self._ask({"outer": outer, "phase": "commit", "ok": ok}, VERDICT, self.timeout)["ok"])

    def outer_step(self, outer: int, tokens: int, seconds: float, attempt, ring: Ring, log, roster=None):
        """One outer step's rounds: sync, `attempt(roster)` (the all-reduce), commit; redone from
        sync on a fresh ring until every member's attempt succeeded. Returns (what the attempt
        returned, seconds waited at the syncs, seconds of the attempt that counted)."""
        waited = 0.0
        while True:
            if roster is None:
                t = time.perf_counter()
                roster = self.sync(outer, tokens, seconds)
                waited += time.perf_counter() - t
            ok, out, t = True, None, time.perf_counter()
            try:
                out = attempt(roster)
                took = time.perf_counter() - t
            except CommError as e:
                log(f"outer step {outer} failed ({e}); regrouping")
                ok = False
                ring.close()  # now, so peers still inside the collective fail too instead of waiting
            if self.commit(outer, ok):
                return out, waited, took
            ring.close()  # someone failed: every rank builds a fresh ring and redoes the step
            roster = None

    def admitted(self, timeout: float) -> dict | None:
        """A joiner: the ROSTER of the outer step that admits it, or None when the run ended first."""
        return self._ask(None, ROSTER, timeout)

    def close(self) -> None:
        self.sock.close()


class Ring:
    """A member's ring for the roster's current epoch (none while it is alone), rebuilt when the
    members change, and the payload bytes it sent each peer over every ring so far (the run
    report's per-link bytes, by name: ranks change with the epoch)."""

    def __init__(self, ctx):
        self.ctx, self.comm, self.epoch, self.names = ctx, None, 0, list(ctx.run.names)
        self.sent: dict[str, int] = {}

    def join(self, roster: dict) -> None:
        if self.comm is not None and roster["epoch"] == self.epoch:
            return
        self.close()
        names, run = roster["names"], self.ctx.run
        self.names, self.epoch = list(names), roster["epoch"]
        if len(names) > 1:
            self.comm = make_comm(
                run.backend,
                names.index(self.ctx.name),
                len(names),
                run.coord_addr,
                run.port,
                self.ctx.secret,
                timeout=run.timeout,
                device=self.ctx.device,
                addrs=roster["addrs"],
                integrity=run.integrity,
                namespace=f"ring-{roster['round']}",  # unique per sync round, so per build
            )

    def close(self) -> None:
        if self.comm is not None:
            for dst, n in self.comm.counter.payload.items():
                self.sent[self.names[dst]] = self.sent.get(self.names[dst], 0) + n
            self.comm.close()
            self.comm = None

    def sent_bytes(self) -> int:
        return sum(self.sent.values()) + (self.comm.counter.total_payload() if self.comm else 0)


def slices(roster: dict, batch: int, name: str) -> tuple[list[tuple[int, int]] | None, int, int]:
    """This member's (lo, hi) per inner step of the next outer step when paced (else None), and
    its first step's slice."""
    paced = roster.get("paced")
    if not paced:
        return None, *roster["ranges"][name]
    names = roster["names"]
    plan = paced_ranges(batch, int(paced["steps"]), [int(paced["counts"][n]) for n in names])[names.index(name)]
    return plan, *plan[0]
