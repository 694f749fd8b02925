"""`smoltrain serve`: a Hugging Face model on ranks (or replicas) behind the OpenAI HTTP API (contract §7, §10)."""

from __future__ import annotations

import os
import sys

from smolnet.errors import UsageError
from smoltrain import validate


def add_arguments(p) -> None:
    from smoltrain.infer.batching import MAX_SLOTS
    from smoltrain.infer.launch import add_placement_arguments

    add_placement_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=validate.PORT, default=8000)
    p.add_argument(
        "--max-batch", type=validate.count(MAX_SLOTS), default=8, help="requests decoded together, per replica"
    )
    p.add_argument(
        "--max-queue", type=validate.count(10**6, lo=0), default=64, help="requests waiting for a slot; past that, 429"
    )
    p.add_argument(
        "--replicas",
        default="auto",
        help="R groups of hosts, each serving the whole model (auto: what `plan --mode serve` finds best)",
    )
    p.add_argument(
        "--concurrency", type=validate.COUNT, help="requests at once, for --replicas auto (default --max-batch)"
    )
    p.add_argument(
        "--api-key", help="require Authorization: Bearer KEY (shows in `ps`: prefer --api-key-file or SMOL_API_KEY)"
    )
    p.add_argument("--api-key-file", metavar="FILE", help="the API key, read from FILE (default: env SMOL_API_KEY)")
    p.add_argument(
        "--max-prompt-tokens",
        type=validate.TOKENS,
        help="the longest prompt, in tokens; longer gets 400 (default: the model's context)",
    )
    p.add_argument(
        "--max-connections",
        type=validate.count(1 << 16),
        default=256,
        help="HTTP connections held at once; past it the stalest unfinished one is dropped, else 503",
    )
    p.add_argument("--max-tokens", type=validate.TOKENS, default=4096, help="the most tokens one request may ask for")
    p.add_argument(
        "--max-body", type=validate.count(1 << 30, lo=64), default=1 << 20, help="the largest request body, in bytes"
    )
    p.add_argument(
        "--read-timeout", type=validate.SECONDS, default=30.0, help="drop a connection silent for this long (s)"
    )


def check(args) -> None:
    """What argparse cannot check alone (numbers are range-checked as they are parsed)."""
    if args.replicas != "auto":
        try:
            args.replicas = int(args.replicas)
        except ValueError:
            raise UsageError(f"--replicas must be a number or auto, got {args.replicas!r}") from None
        if not 1 <= args.replicas <= 256:
            raise UsageError(f"--replicas must be 1..256 or auto, got {args.replicas}")
    args.api_key = api_key(args)
    from smoltrain.infer.server import check_bind

    check_bind(args.host, args.api_key)  # before any rank starts


def api_key(args) -> str | None:
    """--api-key, else --api-key-file, else env SMOL_API_KEY (None: no key)."""
    if args.api_key is not None and args.api_key_file:
        raise UsageError("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.read(4097).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--api-key-file {args.api_key_file}: cannot read it ({e})") from None
        if not key or len(key) > 4096 or any(c.isspace() for c in key):
            raise UsageError(f"--api-key-file {args.api_key_file}: one key of 1-4096 characters, no spaces")
        return key
    key = args.api_key if args.api_key is not None else (os.environ.get("SMOL_API_KEY") or None)  # "" is unset
    where = "--api-key" if args.api_key is not None else "SMOL_API_KEY"
    if key is not None and (not key.strip() or any(c.isspace() for c in key.strip())):
        raise UsageError(f"{where} is empty or has spaces")
    return key.strip() if key is not None else None


def choose(args, placements, hosts) -> tuple[list[list[int]] | None, str]:
    """`plan --mode serve` over these hosts: the best candidate's host groups (None: one model
    over every host), and a line saying why. Advice: a plan that cannot be made is a note."""
    from smoltrain.models.hf import read_config
    from smoltrain.planner import compute as measured
    from smoltrain.planner import serve as sp
    from smoltrain.planner.devices import load_calibration
    from smoltrain.planner.links import find_report, link_model, read_report
    from smoltrain.planner.placement_plan import default_mode
    from smoltrain.planner.ranks import resolve_ranks, share_machine
    from smoltrain.planner.serve import split_evenly

    names = [p.name for p in placements]
    try:
        mc = read_config(os.path.abspath(args.model))
        model = mc.spec()
        ranks = resolve_ranks(len(names), hosts, load_calibration(None))
        ranks, source = measured.apply(ranks, hosts, args.compute, model)
        if hosts is None:
            ranks = share_machine(ranks, busy=len(names))
        links = (read_report(args.links) if args.links else find_report(names)) if hosts else None
        lm = link_model(names, hosts, links, None if hosts else "loopback")
        doc = sp.plan(
            model,
            ranks,
            lm,
            strategy="tp" if args.strategy == "tp" else "pp",
            dtype=args.dtype or mc.dtype,
            concurrency=args.concurrency or args.max_batch,
            max_batch=args.max_batch,
            seq=min(mc.ctx, 256),
            placement=default_mode(args.placement, source == "measured"),  # as open_model places a group
            wire=getattr(args, "wire_dtype", None),
        )
    except Exception as e:  # the plan is advice: say why it is missing
        if args.replicas != "auto":
            return split_evenly(len(names), args.replicas), f"--replicas {args.replicas} (even groups: {e})"
        return None, f"no serve plan ({type(e).__name__}: {e}); one model over every host"
    if args.replicas != "auto":  # the user's count, grouped by measured speed
        want = f"{args.replicas} replicas" if args.replicas > 1 else "split"
        best = next(c for c in doc["candidates"] if c["name"] == want)
        return best["group_index"] if args.replicas > 1 else None, f"--replicas {args.replicas}"
    best = next(c for c in doc["candidates"] if c["name"] == doc["best"])
    why = f"plan --mode serve: {best['name']}, {best['tokens_per_s']:,.1f} tokens/s predicted"
    return (None if best["name"] == "split" else best["group_index"]), why


def groups(args) -> tuple[list | None, str]:
    """The replicas' (placements, hosts) groups, or None for one model over every rank; and why."""
    from smoltrain.infer.launch import resolve
    from smoltrain.planner.serve import split_evenly

    _, placements, hosts = resolve(args)
    n = len(placements)
    if args.replicas != "auto" and args.replicas > n:
        raise UsageError(f"--replicas {args.replicas} needs at least {args.replicas} hosts; there are {n}")
    if getattr(args, "mesh", None):  # each replica is one whole mesh, in placement order
        idx, why = mesh_groups(args, n)
    elif args.replicas == 1 or n == 1:
        idx, why = None, "one host" if n == 1 else "--replicas 1"
    elif hosts is None and args.replicas != "auto":  # loopback ranks are all alike
        idx, why = split_evenly(n, args.replicas), f"--replicas {args.replicas}"
    else:
        idx, why = choose(args, placements, hosts)
    if idx is None:
        return None, why
    return [([placements[i] for i in g], [hosts[i] for i in g] if hosts else None) for g in idx], why


def mesh_groups(args, n: int) -> tuple[list | None, str]:
    """--mesh pp=P,tp=T over n ranks: n / (P x T) replicas of it (--replicas auto, or that count)."""
    from smoltrain.mesh import parse
    from smoltrain.planner.serve import split_evenly

    size = parse(args.mesh, None).world
    r = n // size
    if n % size or args.replicas not in ("auto", r):
        want = "whole meshes" if args.replicas == "auto" else f"{args.replicas} meshes"
        raise UsageError(f"--mesh {args.mesh}: {n} ranks are not {want} of {size} ranks")
    return (None if r == 1 else split_evenly(n, r)), f"--mesh {args.mesh}: {r} replica(s)"


def build(args, log=None):
    """Start the replicas and the service (the HTTP server is the caller's): (Service, [Setup])."""
    import threading

    from smoltrain.infer.api import Limits
    from smoltrain.infer.launch import open_model
    from smoltrain.infer.router import Router
    from smoltrain.infer.service import Service

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    check(args)
    if args.strategy == "local" and args.local is None and not args.inventory:
        args.local = 1
    parts, why = groups(args)
    if parts is None:
        setups = [open_model(args)]
    else:
        setups: list = [None] * len(parts)
        errors: list = []

        def one(i, g):
            try:
                setups[i] = open_model(args, group=g, share=sum(len(p) for p, _ in parts))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i, g)) for i, g in enumerate(parts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            for s in setups:
                if s is not None:
                    s.runner.close()
            raise errors[0]
    s0 = setups[0]
    router = Router([s.runner for s in setups], log)
    svc = Service(
        router,
        s0.tokenizer,
        s0.ckpt.config,
        os.path.basename(s0.cfg.model_dir.rstrip("/")),
        s0.cfg.model_dir,
        names=[list(s.cfg.names) for s in setups],
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        limits=Limits(max_body=args.max_body, max_tokens=args.max_tokens, max_prompt=args.max_prompt_tokens),
        api_key=args.api_key,
        read_timeout=args.read_timeout,
        log=log,
    )
    shape = " + ".join(f"{s.cfg.strategy} on {s.cfg.world_size} rank(s)" for s in setups)
    log(f"{len(setups)} replica(s): {shape} ({why}); max batch {args.max_batch}; chat layout: {svc.chat_layout}")
    for s in setups:  # the decode kernels each rank chose (models.backends): no fallback goes unsaid
        for name, st in zip(s.cfg.names, s.runner.stats()):
            k = (st.get("machine") or {}).get("kernels") or {}
            isa = f" ({k['isa']})" if k.get("isa") else ""
            over = "".join(f"; {b} passed over: {why}" for b, why in (k.get("passed_over") or {}).items())
            log(f"{name}: decode kernels {k.get('backend')}{isa}{over}")
    return svc, setups


def run(args) -> int:
    from smoltrain.infer.server import make_server

    svc, setups = build(args)
    try:
        server = make_server(svc, args.host, args.port, args.max_connections)
    except OSError as e:
        svc.router.close()
        raise UsageError(f"--host {args.host} --port {args.port}: cannot listen: {e.strerror or e}") from None
    host, port = server.server_address[:2]
    print(f"serving {svc.model_id} at http://{host}:{port}/v1", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        svc.router.close()
    return 0
