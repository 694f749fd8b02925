"""The OpenAI HTTP API in front of the model's replicas, on the standard library's threading server.

POST /v1/completions and /v1/chat/completions (with "stream": true as server-sent
events), GET /v1/models, GET /health, GET /metrics. Requests are batched by the model
(continuous batching, `batching.py`), so many are answered at once; past the batch,
up to `max_queue` wait for a slot and the rest get 429 at once. Every answer that is
not a success is a JSON error with a 4xx/5xx status: a bad field, a wrong API key, a
body too large, a model that is down. A client that goes away frees its slot at the
next step; a connection that sends nothing (or half a request) for `read_timeout`
seconds is dropped; the listen backlog holds a burst of connections.
"""

from __future__ import annotations

import hmac
import json
import queue
import select
import socket
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from smoltrain.infer.api import BadRequest, Options, parse_json, request
from smoltrain.infer.metrics import CONTENT_TYPE, endpoint
from smoltrain.infer.runner import RankDied
from smoltrain.infer.service import Service
from smoltrain.infer.sse import Events
from smoltrain.infer.textstream import TextStream

BACKLOG = 1024


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    svc: Service

    def setup(self):
        self.timeout = self.svc.read_timeout  # idle and half-sent connections are dropped after this
        super().setup()

    def handle(self):
        try:
            super().handle()
        except OSError:  # the client reset or vanished between requests: nothing to answer
            self.close_connection = True

    def log_message(self, fmt, *args):  # one line per request on stderr, not the default noise
        self.svc.log(f"{self.address_string()} {fmt % args}")

    def _send(self, status: int, data: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.svc.metrics.requests.labels(endpoint(getattr(self, "path", "")), str(status)).inc()

    def _json(self, status: int, doc: dict) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json")

    def _error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        if getattr(self, "unread", 0):
            self._discard()
        self._json(status, {"error": {"message": message, "type": kind, "code": status}})

    def _discard(self) -> None:
        """Read an unread body before answering: closing a socket with unread data resets it, and the
        client would see a reset instead of the answer. A body too large to bother with: close after."""
        n, self.unread = self.unread, 0
        if n > 4 * self.svc.limits.max_body:
            self.close_connection = True
            return
        try:
            while n > 0:
                got = self.rfile.read(min(n, 1 << 16))
                if not got:
                    break
                n -= len(got)
        except OSError:
            self.close_connection = True

    def _authorized(self) -> bool:
        key = self.svc.api_key
        got = self.headers.get("Authorization", "")
        if key is None or hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
            return True
        self._error(401, "a valid API key is needed: Authorization: Bearer KEY", "authentication_error")
        return False

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals (a malformed request line, headers too long, an
        unknown method) as JSON too."""
        self.close_connection = True
        try:
            self._json(
                code, {"error": {"message": message or explain or "", "type": "invalid_request_error", "code": code}}
            )
        except OSError:
            pass

    def do_GET(self):
        self._safely(self._get)

    def do_POST(self):
        self._safely(self._post)

    def _safely(self, answer):
        try:
            answer()
        except (OSError, TimeoutError):  # the client went away or stalled: nothing left to answer
            self.close_connection = True
        except Exception as e:  # a bug must not take the handler (or the server) down: say so, log it
            self.svc.log(f"error: {type(e).__name__}: {e} answering {self.path}")
            self.close_connection = True
            try:
                self._error(500, f"internal error: {type(e).__name__}", "server_error")
            except OSError:
                pass

    def _get(self):
        path = self.path.split("?")[0]
        if path == "/health":
            dead, alive = self.svc.router.dead, self.svc.router.alive()
            doc = {"status": "dead" if dead else "ok", "error": dead, "replicas": len(self.svc.router.runners)}
            doc.update(alive=alive, served=self.svc.served, disconnects=self.svc.disconnects)
            return self._json(503 if dead else 200, doc)
        if not self._authorized():
            return
        if path == "/metrics":
            self._send(200, self.svc.metrics.render(), CONTENT_TYPE)
        elif path == "/v1/models":
            model = {"id": self.svc.model_id, "object": "model", "created": 0, "owned_by": "smolcluster"}
            self._json(200, {"object": "list", "data": [model]})
        else:
            self._error(404, f"no such endpoint: GET {path}")

    def _post(self):
        try:
            self.unread = max(0, int(self.headers.get("Content-Length") or 0))
        except ValueError:
            self.unread, self.close_connection = 0, True
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
        path = self.path.split("?")[0]
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return self._error(404, f"no such endpoint: POST {path}")
        if not self._authorized():
            return
        try:
            req, opts = self._read_request(path == "/v1/chat/completions")
        except BadRequest as e:
            return self._error(e.status, str(e), e.kind)
        if self.svc.router.dead:
            return self._error(503, f"the model is down: {self.svc.router.dead}", "server_error")
        if not self.svc.enter():
            return self._error(429, f"the server is full ({self.svc.open} requests open); retry later", "rate_limit")
        self._complete(req, opts)

    def _read_request(self, chat: bool):
        if self.headers.get("Transfer-Encoding"):
            raise BadRequest("send the body with a Content-Length (chunked bodies are not accepted)", 411)
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise BadRequest("Content-Length must be a number") from None
        limit = self.svc.limits.max_body
        if not 0 < n <= limit:
            if n > limit:
                self.close_connection = True  # answered before the body arrives
            raise BadRequest(f"the body must be 1 byte to {limit} bytes of JSON", 413 if n > limit else 400)
        try:
            self.unread = 0
            raw = self.rfile.read(n)
        except TimeoutError:
            self.close_connection = True
            raise BadRequest(f"the body did not arrive within {self.svc.read_timeout:g}s", 408) from None
        if len(raw) < n:
            raise BadRequest("the body ended early", 400)
        return request(parse_json(raw), chat, self.svc, self.svc.limits)

    def _gone(self) -> bool:
        """The client closed its end (a read would see the end of the stream)."""
        try:
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _complete(self, req, opts: Options) -> None:
        svc, m = self.svc, self.svc.metrics
        rid = ("chatcmpl-" if opts.chat else "cmpl-") + uuid.uuid4().hex[:16]
        created, t0 = int(time.time()), time.perf_counter()
        events: queue.Queue = queue.Queue()
        try:
            ticket = svc.router.submit(
                req, lambda t: events.put(("token", t)), lambda reason, st, err: events.put(("done", reason, err))
            )
        except RankDied as e:
            svc.left(None, False)
            return self._error(503, f"the model is down: {e}", "server_error")
        m.prompt_tokens.inc(len(req.prompt_ids))
        text, ids = TextStream(svc.tok, opts.stops), []
        out: list[str] = []
        finish, error, last = None, None, t0
        sse = Events(self, rid, created, svc.model_id, opts)
        try:
            while finish is None and error is None:
                try:
                    ev = events.get(timeout=0.2)
                except queue.Empty:
                    ev = None
                if (ev is None or events.empty()) and self._gone():
                    raise OSError("client disconnected")
                if ev is None:
                    continue
                if ev[0] == "done":
                    finish, error = {"length": "length"}.get(ev[1], "stop"), ev[2]
                    continue
                now = time.perf_counter()
                (m.ttft if not ids else m.tpot).observe(now - last)
                last = now
                if not ids:
                    svc.started(ticket.replica)
                    sse.start()
                ids.append(ev[1])
                m.tokens.inc()
                piece = text.push(ev[1])
                out.append(piece)
                sse.piece(piece)
                if text.stopped:
                    ticket.cancel()
                    finish = "stop"
            if error is None:
                out.append(text.finish())
                sse.piece(out[-1])
        except OSError:
            svc.disconnects += 1
            svc.log(f"client {self.address_string()} disconnected; cancelling {rid}")
            ticket.cancel()
            self.close_connection = True
            return
        finally:
            svc.left(ticket.replica, bool(ids))
        if error is not None:
            svc.log(f"error: {error}; request {rid} failed")
            if sse.open:
                return sse.fail(f"the model is down: {error}")
            return self._error(503, f"the model is down: {error}", "server_error")
        svc.served += 1
        n = len(req.prompt_ids)
        usage = {"prompt_tokens": n, "completion_tokens": len(ids), "total_tokens": n + len(ids)}
        if opts.stream:
            return sse.end(finish, usage)
        content = "".join(out)
        choice = {"index": 0, "logprobs": None, "finish_reason": finish, "token_ids": ids}
        choice.update({"message": {"role": "assistant", "content": content}} if opts.chat else {"text": content})
        kind = "chat.completion" if opts.chat else "text_completion"
        doc = {"id": rid, "object": kind, "created": created, "model": svc.model_id, "choices": [choice]}
        self._json(200, dict(doc, usage=usage))


class Server(ThreadingHTTPServer):
    request_queue_size = BACKLOG  # a burst of connections waits in the kernel instead of being reset
    daemon_threads = True

    def handle_error(self, request, client_address):
        """One line in the log instead of the standard library's traceback."""
        import sys

        e = sys.exc_info()[1]
        self.RequestHandlerClass.svc.log(f"error: connection from {client_address[0]}: {type(e).__name__}: {e}")


def make_server(svc: Service, host: str = "127.0.0.1", port: int = 8000) -> Server:
    handler = type("BoundHandler", (Handler,), {"svc": svc})
    return Server((host, port), handler)
