"""Requests over replicas: each to the least busy one that is alive.

`serve --replicas R` runs R copies of the model, each on its own group of hosts (a
Cluster, or one process). Each request goes to the replica with the fewest requests
open (ties: the first). A replica that dies (a rank exits, fails, or stops answering
the health check) leaves the rotation with a log line and the others go on; a
request it was running when it died, before sending a single token, is sent to one
other replica (once: a request that kills replicas must not kill them all). A request
whose own submission failed its replica, or that failed alone (RequestFailed, reason
`error`), is never sent again.
"""

from __future__ import annotations

import threading

from smoltrain.infer.runner import RankDied, RequestFailed


class Ticket:
    """One request's place: which replica runs it now, and how to cancel it."""

    def __init__(self, router: Router, req, on_token, on_done):
        self.router, self.req, self.on_token, self.on_done = router, req, on_token, on_done
        self.replica: int | None = None
        self.rid: int | None = None
        self.tokens = 0
        self.tried: set[int] = set()
        self.cancelled = False
        self.lock = threading.Lock()
        self.submitting = False  # a replica's failure now is this submit's: it raises, never re-sent
        self.held = None  # such a failure when the submit went through after all: delivered after it

    def _token(self, tok: int) -> None:
        self.tokens += 1
        self.on_token(tok)

    def _done(self, reason, stats, error) -> None:
        with self.lock:
            if self.submitting and error and reason is None:
                self.held = (reason, stats, error)
                return
        if error and reason is None and not self.tokens and not self.cancelled and len(self.tried) < 2:
            self.router.log(f"replica {self.replica} failed request before its first token ({error}); retrying")
            try:
                return self.router._place(self)
            except (RankDied, RequestFailed) as e:
                error = str(e)
        self.on_done(reason, stats, error)

    def cancel(self) -> None:
        self.cancelled = True
        if self.replica is not None:
            self.router.runners[self.replica].cancel(self.rid)


class Router:
    def __init__(self, runners: list, log, health_s: float = 2.0):
        self.runners, self.log = runners, log
        self.lock = threading.Lock()
        self.out: set[int] = set()  # replicas taken out of rotation
        self.closed = threading.Event()
        if health_s:
            threading.Thread(target=self._health, args=(health_s,), daemon=True).start()

    @property
    def dead(self) -> str | None:
        """Why nothing can serve (every replica is down), else None."""
        reasons = [r.dead for r in self.runners]
        return None if any(x is None for x in reasons) else "; ".join(dict.fromkeys(reasons))

    def alive(self) -> list[int]:
        return [i for i, r in enumerate(self.runners) if r.dead is None]

    def submit(self, req, on_token, on_done) -> Ticket:
        t = Ticket(self, req, on_token, on_done)
        self._place(t)
        return t

    def _place(self, t: Ticket) -> None:
        """To the least busy live replica not yet tried. A submit that fails the replica raises:
        the request is not sent on (it may be what failed it); RequestFailed passes through."""
        with self.lock:
            order = sorted((i for i in self.alive() if i not in t.tried), key=lambda i: (self.runners[i].load, i))
            if not order:
                raise RankDied(self.dead or "every replica failed this request")
            i = order[0]
            t.tried.add(i)
            t.replica = i
        with t.lock:
            t.submitting, t.held = True, None
        try:
            t.rid = self.runners[i].submit(t.req, t._token, t._done)
        except RankDied:
            self._check(i)
            raise
        finally:
            with t.lock:
                t.submitting, held = False, t.held
        if held is not None:
            t._done(*held)

    def _check(self, i: int) -> None:
        r = self.runners[i]
        if r.dead is not None and i not in self.out:
            self.out.add(i)
            self.log(f"error: replica {i} is out of rotation: {r.dead}")

    def _health(self, every: float) -> None:
        while not self.closed.wait(every):
            for i, r in enumerate(self.runners):
                if r.dead is None:
                    try:
                        r.health()
                    except RankDied:
                        pass
                self._check(i)

    def stats(self) -> list:
        """Per replica: its ranks' counters and links, or None while it is down."""
        out = []
        for r in self.runners:
            try:
                out.append(r.stats() if r.dead is None else None)
            except RankDied:
                out.append(None)
        return out

    def close(self) -> None:
        self.closed.set()
        for r in self.runners:
            r.close()
