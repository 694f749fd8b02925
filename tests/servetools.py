"""`smoltrain serve` in the test's own process: its real argument parser and build, on a free
port, with an openai client bound to it (the serving tests share this)."""

from __future__ import annotations

import argparse
import http.client
import json
import threading

import openai


def start(path: str, *argv: str, key: str) -> dict:
    from smoltrain.commands import serve
    from smoltrain.infer.server import make_server

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--model", path, "--api-key", key, "--timeout", "60", "--threads", "1", *argv])
    logs: list[str] = []
    svc, setups = serve.build(args, log=logs.append)
    server = make_server(svc, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    port = server.server_address[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)
    return {"svc": svc, "server": server, "port": port, "logs": logs, "setups": setups, "client": client}


def stop(s: dict) -> None:
    s["server"].shutdown()
    s["server"].server_close()
    s["svc"].router.close()


def call(port, method, path, body=None, raw=None, headers=None, timeout=60, key: str | None = None):
    """One raw HTTP request (what the openai client cannot send); (status, JSON body or None)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {key}" if key else None, **(headers or {})}
    c.request(method, path, body=data, headers={k: v for k, v in h.items() if v is not None})
    r = c.getresponse()
    out = r.status, r.read()
    c.close()
    return out[0], json.loads(out[1]) if out[1] else None
