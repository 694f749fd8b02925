"""`smoltrain serve`: a Hugging Face model split over ranks behind the OpenAI HTTP API (contract §7)."""

from __future__ import annotations

import sys

from smolnet.errors import UsageError
from smoltrain import validate


def add_arguments(p) -> None:
    from smoltrain.infer.launch import add_placement_arguments

    add_placement_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=validate.PORT, default=8000)


def run(args) -> int:
    import os

    from smoltrain.infer.launch import open_model
    from smoltrain.infer.server import Service, make_server

    if args.strategy == "local" and args.local is None and not args.inventory:
        args.local = 1
    setup = open_model(args)
    try:
        mc = setup.ckpt.config
        svc = Service(setup.runner, setup.tokenizer, mc, os.path.basename(setup.cfg.model_dir.rstrip("/")))
        try:
            server = make_server(svc, args.host, args.port)
        except OSError as e:  # taken, or not an address of this machine
            raise UsageError(f"--host {args.host} --port {args.port}: cannot listen: {e.strerror or e}") from None
        host, port = server.server_address[:2]
        print(
            f"serving {svc.model_id} ({setup.cfg.strategy} on {setup.cfg.world_size} rank(s)) at "
            f"http://{host}:{port}/v1",
            file=sys.stderr,
            flush=True,
        )
        try:
            server.serve_forever(poll_interval=0.5)
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    finally:
        setup.runner.close()
    return 0
