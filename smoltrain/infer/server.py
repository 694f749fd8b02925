"""The OpenAI HTTP API in front of a runner (one process or a Cluster of ranks), stdlib only.

POST /v1/completions and /v1/chat/completions (with "stream": true as server-sent
events), GET /v1/models, GET /health. Requests wait their turn and run one after
another (batch-1 decode). A bad request gets a 4xx JSON error; a client that goes away
mid-stream cancels its request so the next one starts; a dead rank gets a 503 and a
log line, and every later request a 503 too, at once.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from smolnet.errors import SmolError
from smoltrain.infer.engine import Request

MAX_BODY = 1 << 20


class BadRequest(SmolError):
    """A request the API refuses; `status` is the HTTP code of the JSON error."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message, code=2)
        self.status = status


class Service:
    """What the handler needs: the runner, tokenizer and model limits, and a FIFO of requests."""

    def __init__(self, runner, tokenizer, mc, model_id: str, log=None):
        self.runner, self.tok, self.mc, self.model_id = runner, tokenizer, mc, model_id
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.cv = threading.Condition()
        self.next_ticket = self.serving = 0
        self.served = self.disconnects = 0

    def turn(self):
        """Context manager: wait until this request's turn, in arrival order."""
        svc = self

        class _Turn:
            def __enter__(self):
                with svc.cv:
                    self.ticket = svc.next_ticket
                    svc.next_ticket += 1
                    svc.cv.wait_for(lambda: svc.serving == self.ticket)

            def __exit__(self, *exc):
                with svc.cv:
                    svc.serving += 1
                    svc.cv.notify_all()

        return _Turn()

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            ids = prompt
        elif isinstance(prompt, str):
            if self.tok is None:
                raise BadRequest("this model has no tokenizer.json: give the prompt as a list of token ids")
            ids = self.tok.encode(prompt).ids
        else:
            raise BadRequest("prompt must be a string or a non-empty list of token ids")
        if not ids:
            raise BadRequest("the prompt is empty")
        if any(not 0 <= i < self.mc.vocab for i in ids):
            raise BadRequest(f"a prompt token id is outside the vocabulary (0..{self.mc.vocab - 1})")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids) if self.tok is not None else "".join(f" {i}" for i in ids)

    def chat_prompt(self, messages) -> str:
        """A plain chat layout (role: content lines, then `assistant:`); checkpoints' Jinja templates are not run."""
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
        ):
            raise BadRequest("messages must be a non-empty list of {role, content} objects")
        return "".join(f"{m.get('role', 'user')}: {m['content']}\n" for m in messages) + "assistant:"

    def request(self, body: dict, chat: bool) -> Request:
        prompt = self.chat_prompt(body.get("messages")) if chat else body.get("prompt")
        ids = self.encode(prompt)
        try:
            max_new = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            temperature = float(body.get("temperature", 1.0))
            top_p = float(body.get("top_p", 1.0))
            seed = int(body.get("seed") or 0)
        except (TypeError, ValueError):
            raise BadRequest("max_tokens, temperature, top_p and seed must be numbers") from None
        if max_new < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise BadRequest("max_tokens must be >= 1, temperature >= 0 and top_p in (0, 1]")
        if len(ids) + max_new > self.mc.ctx:
            raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens {max_new} exceed the context of {self.mc.ctx}")
        stops = [] if body.get("ignore_eos") or self.mc.eos is None else [self.mc.eos]
        return Request(ids, max_new, temperature, top_p, seed, stops)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    svc: Service

    def log_message(self, fmt, *args):  # one line per request on stderr, not the default noise
        self.svc.log(f"{self.address_string()} {fmt % args}")

    def _json(self, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        self._json(status, {"error": {"message": message, "type": kind, "code": status}})

    def do_GET(self):
        if self.path == "/health":
            dead = self.svc.runner.dead
            self._json(
                503 if dead else 200,
                {
                    "status": "dead" if dead else "ok",
                    "error": dead,
                    "served": self.svc.served,
                    "disconnects": self.svc.disconnects,
                },
            )
        elif self.path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [{"id": self.svc.model_id, "object": "model", "created": 0, "owned_by": "smolcluster"}],
                },
            )
        else:
            self._error(404, f"no such endpoint: GET {self.path}")

    def do_POST(self):
        chat = self.path == "/v1/chat/completions"
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._error(404, f"no such endpoint: POST {self.path}")
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if not 0 < n <= MAX_BODY:
                raise BadRequest(f"the body must be 1 byte to {MAX_BODY} bytes of JSON", 413 if n > MAX_BODY else 400)
            try:
                body = json.loads(self.rfile.read(n))
            except ValueError as e:
                raise BadRequest(f"the body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            req = self.svc.request(body, chat)
        except BadRequest as e:
            self.close_connection = True
            return self._error(e.status, str(e))
        if self.svc.runner.dead:
            return self._error(503, f"the model is down: {self.svc.runner.dead}", "server_error")
        with self.svc.turn():
            self._complete(req, body, chat)

    def _complete(self, req: Request, body: dict, chat: bool) -> None:
        from smoltrain.infer.runner import RankDied

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        stream = bool(body.get("stream"))
        created = int(time.time())
        ids: list[int] = []
        state = {"shown": "", "gone": False}

        def chunk(delta: str, finish=None) -> dict:
            choice = (
                {"index": 0, "delta": {"content": delta} if delta else {}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": delta, "finish_reason": finish}
            )
            return {
                "id": rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": self.svc.model_id,
                "choices": [choice],
            }

        def send_event(doc) -> None:
            if state["gone"]:
                return
            try:
                data = b"data: " + (doc if isinstance(doc, bytes) else json.dumps(doc).encode()) + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            except OSError:  # the client went away: free the slot for the next request
                state["gone"] = True
                self.svc.disconnects += 1
                self.svc.log(f"client {self.address_string()} disconnected mid-stream; cancelling {rid}")
                self.svc.runner.cancel()

        def on_token(t: int) -> None:
            ids.append(t)
            if stream:
                text = self.svc.decode(ids)
                delta = text[len(state["shown"]) :] if text.startswith(state["shown"]) else text
                state["shown"] = text
                send_event(chunk(delta))

        if stream:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
        try:
            self.svc.runner.generate(req, on_token=on_token)
        except RankDied as e:
            self.svc.log(f"error: a rank died: {e}; answering 503 from now on")
            self.close_connection = True
            if stream:
                send_event({"error": {"message": f"the model is down: {e}", "type": "server_error", "code": 503}})
                self._end_chunks(state)
                return
            return self._error(503, f"the model is down: {e}", "server_error")
        self.svc.served += 1
        finish = "length" if len(ids) >= req.max_new_tokens else "stop"
        if stream:
            send_event(chunk("", finish))
            send_event(b"[DONE]")
            self._end_chunks(state)
            return
        text = self.svc.decode(ids)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            if chat
            else {"index": 0, "text": text, "finish_reason": finish}
        )
        choice["token_ids"] = ids
        n = len(req.prompt_ids)
        self._json(
            200,
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.svc.model_id,
                "choices": [choice],
                "usage": {"prompt_tokens": n, "completion_tokens": len(ids), "total_tokens": n + len(ids)},
            },
        )

    def _end_chunks(self, state) -> None:
        if not state["gone"]:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass


def make_server(svc: Service, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"svc": svc})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
