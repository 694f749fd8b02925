"""`serve` against hostile input (issue 41): a 12k-token prompt on a 32k-context model is served
(its ids travel as frame payloads) or refused past --max-prompt-tokens, and every replica serves
the next request (1 replica of pp over 2 ranks; 2 replicas); one request's engine failure is that
request's alone; the router never re-sends a request whose submit failed its replica; 2,000
trickling connections are shed while a legitimate client is answered; a chat template that loops
or grows without end gets a 400 naming its budget; Host/Origin, Content-Length, surrogates,
/health, escaped logs, admission before parsing, and no key on a LAN address."""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
import servetools
from infer_models import LLAMA3_TEMPLATE, make_chat_checkpoint, make_checkpoint
from ports import free_port

KEY = "sk-hostile"
LONG = 12_000  # tokens: with 5-digit ids, ~72 KB of JSON, past the 64 KiB a frame's header may hold


def start(path: str, *argv: str) -> dict:
    return servetools.start(path, *argv, key=KEY)


stop = servetools.stop


def call(port, method, path, body=None, raw=None, headers=None, timeout=60):
    return servetools.call(port, method, path, body, raw, headers, timeout, key=KEY)


def long_prompt(n: int, seed: int = 0) -> list[int]:
    return [10_000 + (i * 7919 + seed) % 22_000 for i in range(n)]  # 5-digit ids, as a real vocabulary's


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A tiny Llama with a 32k context and a 32k vocabulary (Llama 3 and Qwen have long contexts)."""
    path = str(tmp_path_factory.mktemp("hf") / "long")
    return make_checkpoint(path, "llama", layers=2, vocab=32_000, ctx=32_768)


def served(client, prompt, new=2) -> list[int]:
    r = client.completions.create(
        model="long", prompt=prompt, max_tokens=new, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].model_extra["token_ids"]


def test_long_prompt_one_pp_replica_is_served_and_the_model_goes_on(long_model):
    s = start(long_model, "--strategy", "pp", "--local", "2", "--replicas", "1", "--max-batch", "2")
    try:
        client = s["client"]
        before = served(client, [5, 6, 7], 3)
        assert len(served(client, long_prompt(LONG), 2)) == 2  # a lost rank (503) on JSON-header ids
        assert served(client, [5, 6, 7], 3) == before
        assert call(s["port"], "GET", "/health")[1]["status"] == "ok"
    finally:
        stop(s)


def test_long_prompts_on_two_replicas_and_the_prompt_limit(long_model):
    s = start(long_model, "--local", "2", "--replicas", "2", "--max-batch", "2", "--max-prompt-tokens", str(LONG))
    try:
        client = s["client"]
        with pytest.raises(openai.BadRequestError, match=f"at most {LONG} \\(--max-prompt-tokens\\)"):
            served(client, long_prompt(LONG + 1))
        got: list = []
        ts = [threading.Thread(target=lambda i=i: got.append(served(client, long_prompt(LONG, i)))) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        assert [len(g) for g in got] == [2, 2]
        for _ in range(4):  # both replicas serve on
            assert len(served(client, [5, 6, 7], 3)) == 3
        st, doc = call(s["port"], "GET", "/health")
        assert st == 200 and doc["alive"] == [0, 1], doc
        text = s["svc"].metrics.render().decode()
        assert 'smol_replica_requests_total{replica="0"}' in text and 'smol_replica_requests_total{replica="1"}' in text
        assert not any("out of rotation" in ln for ln in s["logs"]), s["logs"]
    finally:
        stop(s)


def test_token_ids_travel_as_payload():
    from smolnet import wire
    from smoltrain.infer.runner import RequestFailed, pack_ids, unpack_ids

    ids = long_prompt(20_000)
    a, b = socket.socketpair()
    with a, b:
        threading.Thread(target=wire.send_frame, args=(a, 1, {"type": "admit"}, pack_ids(ids)), daemon=True).start()
        kind, meta, payload = wire.recv_frame(b, timeout=10)
    assert meta == {"type": "admit"} and unpack_ids(payload) == ids
    with pytest.raises(RequestFailed, match="32-bit"):
        pack_ids([1, 2**40])
    with pytest.raises(ValueError, match="whole int32"):
        unpack_ids(b"\0" * 5)


def test_one_requests_engine_failure_is_its_own(long_model):
    """A real LocalRunner: a step that raises (an id past the embedding) fails that request alone."""
    import types

    from smoltrain.infer.batching import Request
    from smoltrain.infer.launch import open_model

    args = types.SimpleNamespace(
        model=long_model, strategy="local", local=1, inventory=None, dtype=None, quantize=None, wire_dtype=None,
        backend="socket", timeout=60.0, max_batch=2, threads=1, device=None, placement=None, compute=None, links=None,
    )  # fmt: skip
    setup = open_model(args)
    try:
        ends: dict = {}

        def run(name, prompt):
            done = threading.Event()

            def on_done(reason, stats, error):
                ends[name] = (reason, error)
                done.set()

            setup.runner.submit(Request(prompt, 2, 0.0, 1.0, 0, []), lambda t: None, on_done)
            assert done.wait(60)

        run("bad", [5, 99_999])
        run("good", [5, 6])
        assert ends["bad"][0] == "error" and "IndexError" in ends["bad"][1], ends
        assert ends["good"] == ("length", None) and setup.runner.dead is None
    finally:
        setup.runner.close()


def test_router_never_resends_a_request_whose_submit_failed_its_replica():
    from smoltrain.infer.router import Router
    from smoltrain.infer.runner import RankDied

    class Replica:  # what Router reads of a runner; the first one fails on submit, as a lost rank did
        def __init__(self, fails):
            self.fails, self.dead, self.load, self.got = fails, None, 0, []

        def submit(self, req, on_token, on_done):
            self.got.append(req)
            if self.fails:
                self.dead = "rank1: control connection lost"
                on_done(None, None, self.dead)  # what _fail does to every open request, this one too
                raise RankDied(self.dead)
            return 1

    a, b = Replica(True), Replica(False)
    router = Router([a, b], log=lambda m: None, health_s=0)
    ended: list = []
    with pytest.raises(RankDied):
        router.submit("req", lambda t: None, lambda *x: ended.append(x))
    assert a.got == ["req"] and b.got == [] and ended == []
    router.submit("next", lambda t: None, lambda *x: None)
    assert b.got == ["next"]


# --- the HTTP server ---

BAD_TEMPLATE = (
    "{% set c = messages[0]['content'] %}"
    "{% if c == 'nest6' %}{% for i in range(10**6) %}{% for j in range(10**6) %}x{% endfor %}{% endfor %}"
    "{% elif c == 'nest5' %}{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}"
    "{% elif c == 'huge' %}{{ 'x' * 10**10 }}"
    "{% else %}" + LLAMA3_TEMPLATE + "{% endif %}"
)


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    path = make_chat_checkpoint(str(tmp_path_factory.mktemp("hf") / "chat"))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump(dict(cfg, chat_template=BAD_TEMPLATE), f)
    s = start(path, "--strategy", "local", "--max-batch", "1", "--max-queue", "0", "--read-timeout", "5")
    yield s
    stop(s)


def chat(content):
    return {"model": "chat", "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def test_templates_run_on_a_budget(chat_server):
    port = chat_server["port"]
    for content, words in (("nest6", "MAX_RANGE (100000)"), ("nest5", "time limit of 2s"), ("huge", "limited to")):
        st, doc = call(port, "POST", "/v1/chat/completions", chat(content), timeout=30)
        assert st == 400 and words in doc["error"]["message"], doc
    assert call(port, "POST", "/v1/chat/completions", chat("hello"))[0] == 200


def test_admission_comes_before_the_body_is_parsed(chat_server):
    port = chat_server["port"]  # capacity 1: a request whose body is still arriving holds it
    with socket.create_connection(("127.0.0.1", port)) as held:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer {KEY}\r\nContent-Length: 200\r\n\r\n"
        held.sendall(head.encode() + b'{"model"')
        time.sleep(0.3)
        st, doc = call(port, "POST", "/v1/chat/completions", chat("nest5"), timeout=30)  # never rendered
        assert st == 429, doc
    deadline = time.monotonic() + 20
    while call(port, "POST", "/v1/chat/completions", chat("hello"))[0] != 200:
        assert time.monotonic() < deadline, "the held slot was never freed"
        time.sleep(0.1)


def test_hostile_headers_and_bodies(chat_server):
    s = chat_server
    port, body = s["port"], {"model": "chat", "prompt": [5, 6], "max_tokens": 2}
    for headers, status in (
        ({"Host": "evil.example:8000"}, 403),  # DNS rebinding
        ({"Origin": "http://evil.example"}, 403),  # a web page's cross-origin POST
        ({"Origin": "null"}, 403),
        ({"Origin": f"http://127.0.0.1:{port}"}, 200),
        ({"Host": f"localhost:{port}"}, 200),
    ):
        st, doc = call(port, "POST", "/v1/completions", body, headers=headers)
        assert st == status, (headers, doc)
    for length in ("-5", "+5", "5_0", " "):
        raw = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Length: {length}\r\n\r\n{{}}"
        )
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sk:
            sk.sendall(raw.encode())
            head, _, rest = sk.makefile("rb").read().partition(b"\r\n\r\n")
        assert head.split()[1] == b"400" and b"Content-Length" in rest, (length, head)
    st, doc = call(port, "POST", "/v1/completions", raw=b'{"prompt": "a \\ud800 b", "max_tokens": 2}')
    assert st == 400 and "surrogate" in doc["error"]["message"]
    st, doc = call(port, "GET", "/health", headers={"Authorization": None})
    assert (st, doc) == (200, {"status": "ok"})
    st, doc = call(port, "GET", "/health")
    assert st == 200 and doc["replicas"] == 1
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sk:  # ANSI and a fake line in the path
        sk.sendall(b"GET /\x1b[31mred\nFAKE HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        sk.makefile("rb").read()
    lines = [ln for ln in s["logs"] if "red" in ln]
    assert lines and not any("\x1b" in ln or "\n" in ln for ln in s["logs"]) and "\\x1b[31mred" in lines[-1]


def test_a_lan_address_needs_a_key(tmp_path, capsys, monkeypatch):
    from smoltrain.cli import main

    model = str(tmp_path / "nothing-loaded")  # refused before any model is read
    monkeypatch.delenv("SMOL_API_KEY", raising=False)
    assert main(["serve", "--local", "1", "--model", model, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host 0.0.0.0 serves other machines" in err[0], err
    from smoltrain.commands import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    args = p.parse_args(["--model", model, "--host", "0.0.0.0", "--api-key-file", str(key_file)])
    serve.check(args)
    assert args.api_key == "sk-from-file"
    monkeypatch.setenv("SMOL_API_KEY", "sk-from-env")
    args = p.parse_args(["--model", model, "--host", "0.0.0.0"])
    serve.check(args)
    assert args.api_key == "sk-from-env"


def test_two_thousand_trickling_connections_are_shed(tmp_path):
    """2,000 connections that each send a byte and stall (as one that sends a byte every 20 s):
    the server, held to 1,024 descriptors as many hosts are, stays up, sheds them, and answers a
    legitimate client. (Without a cap they exhausted its descriptors and its accept loop spun.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2300:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} < 2300: raise it (ulimit -Hn) to run this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096) if hard == resource.RLIM_INFINITY else hard, hard))
    path = make_checkpoint(str(tmp_path / "gpt2"), "gpt2", layers=2)
    port = free_port()
    argv = ["serve", "--strategy", "local", "--model", path, "--port", str(port), "--threads", "1"]
    argv += ["--read-timeout", "30"]  # and the default cap of 256 connections

    def limited():
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))

    proc = subprocess.Popen(
        [sys.executable, "-m", "smoltrain", *argv], stderr=subprocess.PIPE, text=True, preexec_fn=limited
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    socks: list[socket.socket] = []
    body = {"prompt": [3, 5, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        deadline = time.monotonic() + 120
        while not any(f"127.0.0.1:{port}/v1" in ln for ln in lines):
            assert proc.poll() is None and time.monotonic() < deadline, lines
            time.sleep(0.1)
        t0 = time.perf_counter()
        want = call(port, "POST", "/v1/completions", body)[1]["choices"][0]["token_ids"]
        alone = time.perf_counter() - t0
        for _ in range(2000):
            sk = socket.create_connection(("127.0.0.1", port), timeout=10)
            sk.sendall(b"P")
            socks.append(sk)
        t0 = time.perf_counter()
        st, doc = call(port, "POST", "/v1/completions", body, timeout=20)
        print(f"a legitimate request: {alone:.3f}s alone, {time.perf_counter() - t0:.3f}s beside 2,000 trickling")
        assert st == 200 and doc["choices"][0]["token_ids"] == want
        st, doc = call(port, "GET", "/health", timeout=20)
        assert st == 200 and doc["status"] == "ok"
        shed = 0
        for sk in socks:  # those the server let go: a 503 (or the end of the stream) is waiting
            sk.setblocking(False)
            try:
                shed += sk.recv(12) in (b"HTTP/1.1 503", b"")
            except BlockingIOError:
                pass
            except OSError:
                shed += 1
        assert shed >= 2000 - 256, shed
        assert proc.poll() is None
    finally:
        for sk in socks:
            sk.close()
        proc.terminate()
        proc.wait(30)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_accept_pauses_when_descriptors_run_out():
    """Out of descriptors (EMFILE), the listener stays readable: accept() is tried a few times a
    second, not thousands (the loop used to spin on it)."""
    from http.server import BaseHTTPRequestHandler

    from smoltrain.infer.conns import Server

    class Quiet(BaseHTTPRequestHandler):
        def handle(self):
            self.request.recv(1)  # holds its descriptor until the client closes

    tries = [0]

    class Counted(Server):
        def get_request(self):
            tries[0] += 1
            return super().get_request()

    server = Counted(("127.0.0.1", 0), Quiet, max_connections=10_000)  # no cap below the descriptors
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    socks: list[socket.socket] = []
    try:  # 20 connections wait in the backlog; the server may open 4 more descriptors
        socks = [socket.create_connection(server.server_address, timeout=5) for _ in range(20)]
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        time.sleep(1.0)
        assert 0 < tries[0] < 100, tries[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for sk in socks:
            sk.close()
        server.shutdown()
        server.server_close()
