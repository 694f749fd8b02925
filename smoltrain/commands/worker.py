"""`smoltrain worker`: one rank of a run (started by `smoltrain run`, or by hand to join an edp run).

The cluster secret is read from standard input (one line), never from the command line.
"""

from __future__ import annotations

import sys

from smolnet.errors import UsageError
from smolnet.secret import parse_secret


def add_arguments(p) -> None:
    p.add_argument("--control", required=True, metavar="ADDR:PORT", help="the controller's control channel")
    p.add_argument("--rank", type=int, default=-1, help="this worker's rank (omit with --join)")
    p.add_argument("--join", action="store_true", help="join a running edp run as a newcomer")


def run(args) -> int:
    addr, _, port = args.control.rpartition(":")
    if not addr or not port.isdigit():
        raise UsageError(f"--control {args.control}: expected ADDR:PORT")
    if args.rank < 0 and not args.join:
        raise UsageError("give --rank R, or --join to join an elastic run")
    secret = parse_secret(sys.stdin.buffer.readline(), "stdin")
    import faulthandler

    faulthandler.enable()  # a native crash leaves its Python stack in the log, not silence
    from smoltrain.run.worker import worker_main

    return worker_main(addr, int(port), secret, args.rank, args.join)
