"""Who broke the run: decided from every rank's view, not from the first error to arrive.

Why: when a host is cut off, each of its ring neighbours reports a broken link, and so may
the cut host itself (naming a healthy neighbour). Whichever error reaches the controller first
used to be blamed. Here the controller gathers, for a short window, every rank's error (with
the peer its transport named), which ranks went silent (no authenticated heartbeat) and which
died without a word, and only then names the culprit:
  0. the controller itself, when it was stopped longer than the workers wait for its heartbeat
     (SIGSTOP, a suspended machine): they gave up on it, so their silence or exit is its doing;
  1. a rank that died without reporting an error, or whose heartbeats stopped (first by rank);
  2. else the rank the most other ranks accuse (ties: the lower rank);
  3. else the first rank that reported an error (its own failure: a bug, a bad input, NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Views:
    """What the controller has heard from each rank since the first sign of failure."""

    names: list[str]
    errors: dict[str, dict] = field(default_factory=dict)  # name -> {"message", "peer"}
    order: list[str] = field(default_factory=list)  # names in the order their errors came
    silent: dict[str, float] = field(default_factory=dict)  # name -> seconds without a heartbeat
    died: dict[str, str] = field(default_factory=dict)  # name -> last log line
    stalled: float = 0.0  # seconds the controller itself was stopped, beyond what workers wait

    def error(self, who: str, message: str, peer: str | None) -> None:
        if who not in self.errors:
            self.errors[who] = {"message": message, "peer": peer}
            self.order.append(who)

    def complete(self, alive: set[str]) -> bool:
        """Every rank still expected has had its say (an error, silence or death)."""
        heard = set(self.errors) | set(self.silent) | set(self.died)
        return all(n in heard for n in self.names if n in alive)


def _rank(views: Views, name: str) -> int:
    return views.names.index(name) if name in views.names else 1 << 20


def culprit(views: Views) -> tuple[str, str]:
    """(name, one-line reason) of the rank or link to blame."""
    if views.stalled:
        return "controller", (
            f"stopped itself for {views.stalled:.1f}s (SIGSTOP, a suspended or overloaded machine): "
            "its workers heard no heartbeat and gave up on it"
        )
    gone = [n for n in views.names if n in views.died and n not in views.errors]
    if gone:
        who = gone[0]
        return who, f"worker exited before finishing ({views.died[who] or 'no log'})"
    silent = [n for n in views.names if n in views.silent]
    if silent:
        who = silent[0]
        return who, (f"no heartbeat for {views.silent[who]:.1f}s: the process is stopped or its host is cut off")
    accused: dict[str, list[str]] = {}
    for who, e in views.errors.items():
        if e.get("peer") and e["peer"] != who:
            accused.setdefault(e["peer"], []).append(who)
    if accused:
        who = min(accused, key=lambda n: (-len(accused[n]), _rank(views, n)))
        by = sorted(accused[who], key=lambda n: _rank(views, n))
        first = views.errors[by[0]]["message"]
        own = views.errors.get(who)
        if own and not own.get("peer"):  # it failed by itself, and its neighbours noticed
            return who, own["message"]
        return who, f"lost by {', '.join(by)} ({first})"
    if views.order:
        who = views.order[0]
        return who, views.errors[who]["message"]
    return "", "unknown failure"
