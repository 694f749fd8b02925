"""`smoltrain serve`: the OpenAI HTTP API over a pp cluster of two loopback ranks; concurrent requests
are served one after another and each gets transformers' tokens; bad requests get 4xx JSON; a client
gone mid-stream frees the slot; a dead rank gives 503, not a hang."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest
from infer_models import make_checkpoint, reference

PROMPTS = [[3, 5, 7, 9], [11, 13], [2, 4, 6, 8, 10, 12]]
NEW = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from smoltrain.infer.launch import open_model
    from smoltrain.infer.server import Service, make_server

    path = make_checkpoint(str(tmp_path_factory.mktemp("hf") / "llama"), "llama", layers=3)
    want = [reference(path, p, NEW) for p in PROMPTS]
    args = argparse.Namespace(
        strategy="pp",
        local=2,
        inventory=None,
        model=path,
        backend="socket",
        dtype=None,
        placement="even",
        timeout=60.0,
        secret_file=None,
    )
    setup = open_model(args)
    logs: list[str] = []
    svc = Service(setup.runner, setup.tokenizer, setup.ckpt.config, "llama", log=logs.append)
    server = make_server(svc, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    yield server.server_address[1], want, setup, logs
    server.shutdown()
    server.server_close()
    setup.runner.close()


def call(port, method, path, body=None, raw=None, timeout=60):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.status, r.read()
    c.close()
    return out[0], json.loads(out[1]) if out[1] else None


def completion(prompt, **kw):
    return dict({"model": "llama", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}, **kw)


def test_models_health_and_concurrent_requests(served):
    port, want, _, _ = served
    assert call(port, "GET", "/health")[0] == 200
    st, doc = call(port, "GET", "/v1/models")
    assert st == 200 and doc["data"][0]["id"] == "llama"
    results = {}

    def one(i):
        results[i] = call(port, "POST", "/v1/completions", completion(PROMPTS[i]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(len(PROMPTS)):
        st, doc = results[i]
        assert st == 200, doc
        assert doc["choices"][0]["token_ids"] == want[i]
        assert doc["usage"] == {
            "prompt_tokens": len(PROMPTS[i]),
            "completion_tokens": NEW,
            "total_tokens": len(PROMPTS[i]) + NEW,
        }


def test_bad_requests_get_4xx_json(served):
    port, want, _, _ = served
    st, doc = call(port, "POST", "/v1/completions", raw=b"{not json")
    assert st == 400 and "not JSON" in doc["error"]["message"]
    st, doc = call(port, "POST", "/v1/completions", completion("hello"))
    assert st == 400 and "tokenizer" in doc["error"]["message"]
    st, doc = call(port, "POST", "/v1/completions", completion([1] * 60))
    assert st == 400 and "context" in doc["error"]["message"]
    st, doc = call(port, "POST", "/v1/chat/completions", {"messages": "hi"})
    assert st == 400 and "messages" in doc["error"]["message"]
    st, doc = call(port, "GET", "/v1/nothing")
    assert st == 404 and doc["error"]["code"] == 404
    assert call(port, "POST", "/v1/completions", completion(PROMPTS[0]))[1]["choices"][0]["token_ids"] == want[0]


def stream_events(port, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    return c, r


def test_stream_and_disconnect_mid_stream(served):
    port, want, _, logs = served
    c, r = stream_events(port, completion(PROMPTS[0], stream=True))
    events = [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
    c.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == "".join(f" {t}" for t in want[0])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    long = completion(PROMPTS[1], stream=True, max_tokens=60)
    c, r = stream_events(port, long)
    r.fp.readline()  # the first chunk's size line: generation has started
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    st, doc = call(port, "POST", "/v1/completions", completion(PROMPTS[2]))
    assert st == 200 and doc["choices"][0]["token_ids"] == want[2]
    assert any("disconnected mid-stream" in ln for ln in logs)


def test_dead_rank_gives_503(served):
    port, _, setup, logs = served
    proc = setup.runner.procs[1]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    st, doc = call(port, "POST", "/v1/completions", completion(PROMPTS[0]))
    assert st == 503 and "rank1" in doc["error"]["message"]
    assert any("a rank died" in ln for ln in logs)
    assert call(port, "POST", "/v1/completions", completion(PROMPTS[0]))[0] == 503
    assert call(port, "GET", "/health")[0] == 503


def test_serve_command_starts_and_answers(tmp_path):
    path = make_checkpoint(str(tmp_path / "gpt2"), "gpt2", layers=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "smoltrain", "serve", "--strategy", "local", "--model", path, "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        assert f"127.0.0.1:{port}/v1" in line, line
        st, doc = call(
            port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        )
        assert st == 400 and "tokenizer" in doc["error"]["message"]
        st, doc = call(port, "POST", "/v1/completions", completion([3, 5, 7], max_tokens=4))
        assert st == 200 and doc["choices"][0]["token_ids"] == reference(path, [3, 5, 7], 4)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_port_in_use_is_one_line_not_a_traceback(served, capsys):
    from smoltrain.cli import main

    port, _, setup, _ = served  # the fixture's server holds this port
    rc = main(["serve", "--strategy", "local", "--model", setup.cfg.model_dir, "--port", str(port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and f"--port {port}: cannot listen" in err[-1], err
