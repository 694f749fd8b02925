"""`smolnet agent`: serve measurements on this host until stopped."""

from __future__ import annotations

import logging
import signal
import sys

from smolnet.errors import SmolError, UsageError
from smolnet.secret import SecretError, load_secret, parse_secret


def add_arguments(p) -> None:
    p.add_argument("--bind", required=True, help="address to listen on (the host's cluster_ip)")
    p.add_argument("--port", type=int, default=7650, help="TCP and UDP port (default 7650)")
    p.add_argument("--secret-file", default=None, help="default: ~/.config/smolcluster/secret")
    p.add_argument(
        "--secret-stdin",
        action="store_true",
        help="read the secret from the first line of standard input (how matrix starts agents)",
    )
    p.add_argument("--iface", default=None, help="cluster interface, when it is not the one holding --bind")
    p.add_argument(
        "--lease",
        type=float,
        default=None,
        metavar="SECONDS",
        help="exit when no controller request renews the lease for this long (how matrix starts agents)",
    )


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} outside 0..65535")
    if args.lease is not None and not args.lease > 0:
        raise UsageError(f"--lease {args.lease}: must be a positive number of seconds")
    if args.secret_stdin:
        line = sys.stdin.buffer.readline(8192)
        try:
            secret = parse_secret(line, "standard input")
        except SecretError as e:
            raise UsageError(str(e)) from None
    else:
        secret = load_secret(args.secret_file)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s smolnet-agent %(levelname)s %(message)s")
    from smolnet.agent import Agent

    try:
        agent = Agent(args.bind, args.port, secret, iface=args.iface, lease=args.lease)
    except OSError as e:
        raise SmolError(f"cannot listen on {args.bind}:{args.port}: {e.strerror or e}") from None

    def _term(signum, frame):
        agent.stop()

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    logging.getLogger("smolnet.agent").info("listening on %s:%d (tcp+udp)", args.bind, agent.port)
    print(f"smolnet agent listening on {args.bind}:{agent.port}", flush=True)
    agent.serve_forever()
    return 0
