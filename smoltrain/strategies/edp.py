"""edp: elastic data parallel: workers leave and join while training goes on.

Built on the same parameter server as `syncps` (see `smoltrain.strategies.parameter_server`):
rank 0 holds the master parameters and AdamW state and tracks membership. What
makes it elastic:
  - a worker that dies (SIGKILL, a lost link) or misses the barrier timeout is
    dropped with a `leave` event; the survivors finish the step and go on, the
    global batch re-split over them from the next step;
  - a newcomer can connect at any time (`smoltrain worker --control ADDR --join`,
    or another `-i` host): it is admitted at the next step boundary with a `join`
    event and receives the current parameters with its first assignment, so it
    needs no checkpoint and no optimizer state (the server has it).
Losing the coordinator (rank 0) ends the run; checkpoints make that recoverable.

What crosses the wire, per step and per member other than rank 0: parameters
server -> worker (P*4 bytes) and gradients worker -> server (P*4 bytes), as in
syncps; a join costs nothing extra because every step already ships the
parameters. Every step still covers the whole global batch (re-split over the
members present), so the curve matches `--local 1` until a member is lost
mid-step: that one step averages only the survivors' sequences.
"""

from __future__ import annotations

from smoltrain.strategies.syncps import SyncParameterServer


class ElasticDataParallel(SyncParameterServer):
    """The syncps worker and server; the registry's `joiners` trait opens the server to newcomers."""


STRATEGY = ElasticDataParallel
