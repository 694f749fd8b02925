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
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from smoltrain.infer.api import BadRequest, Limits, Options, parse_json, request
from smoltrain.infer.chat import Chat, ChatError
from smoltrain.infer.metrics import CONTENT_TYPE, Metrics
from smoltrain.infer.runner import RankDied
from smoltrain.infer.textstream import TextStream

BACKLOG = 1024
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def endpoint(path: str) -> str:
    """The metrics label of a request's path (`other` for the rest: scanners must not grow the label set)."""
    p = path.split("?")[0]
    return p if p in ENDPOINTS else "other"


class Service:
    """What the handlers share: the replicas (a Router), the tokenizer and chat layout, limits, metrics."""

    def __init__(
        self,
        router,
        tokenizer,
        mc,
        model_id: str,
        model_dir: str | None = None,
        *,
        names: list[list[str]] | None = None,
        max_batch: int = 8,
        max_queue: int = 64,
        limits: Limits | None = None,
        api_key: str | None = None,
        read_timeout: float = 30.0,
        log=None,
    ):
        self.router, self.tok, self.mc, self.model_id = router, tokenizer, mc, model_id
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.chat = Chat(model_dir, tokenizer) if model_dir and tokenizer is not None else None
        self.stop_ids = self.chat.stop_ids(model_dir, mc.eos) if self.chat else ([] if mc.eos is None else [mc.eos])
        self.max_batch, self.max_queue = max_batch, max_queue
        self.limits, self.api_key, self.read_timeout = limits or Limits(), api_key, read_timeout
        names = names or [[f"rank{r}"] for r in range(len(router.runners))]
        self.metrics = Metrics(router, names)
        self.lock = threading.Lock()
        self.open = self.waiting = 0
        self.active = [0] * len(router.runners)
        self.served = self.disconnects = 0

    @property
    def chat_layout(self) -> str:
        if self.chat is None:
            return "none (no tokenizer.json)"
        return "the checkpoint's chat template" if self.chat.template is not None else "plain (role: content lines)"

    # --- prompts ---
    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]  # the API's list of one prompt
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

    def chat_ids(self, messages) -> list[int]:
        if self.chat is None:
            raise BadRequest("this model has no tokenizer.json, so chat messages cannot be tokenized")
        try:
            ids = self.chat.prompt_ids(messages)
        except ChatError as e:
            raise BadRequest(str(e)) from None
        if not ids:
            raise BadRequest("the chat prompt is empty")
        return ids

    # --- the queue ---
    def capacity(self) -> int:
        return self.max_batch * max(1, len(self.router.alive())) + self.max_queue

    def enter(self) -> bool:
        with self.lock:
            if self.open >= self.capacity():
                return False
            self.open += 1
            self.waiting += 1
            self.metrics.queue.set(self.waiting)
            return True

    def started(self, replica: int) -> None:
        self.metrics.routed.labels(str(replica)).inc()
        with self.lock:
            self.waiting -= 1
            self.active[replica] += 1
            self.metrics.queue.set(self.waiting)
            self.metrics.batch.labels(str(replica)).set(self.active[replica])

    def left(self, replica: int | None, started: bool) -> None:
        with self.lock:
            self.open -= 1
            if started:
                self.active[replica] -= 1
                self.metrics.batch.labels(str(replica)).set(self.active[replica])
            else:
                self.waiting -= 1
                self.metrics.queue.set(self.waiting)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    svc: Service

    def setup(self):
        self.timeout = self.svc.read_timeout  # idle and half-sent connections are dropped after this
        super().setup()

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
        sse = _Events(self, rid, created, svc.model_id, opts)
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


class _Events:
    """A streamed answer: server-sent events in HTTP chunks, in the OpenAI chunk format."""

    def __init__(self, h: Handler, rid: str, created: int, model: str, opts: Options):
        self.h, self.opts, self.open = h, opts, False
        kind = "chat.completion.chunk" if opts.chat else "text_completion"
        self.base = {"id": rid, "object": kind, "created": created, "model": model}

    def _write(self, payload: bytes) -> None:
        data = b"data: " + payload + b"\n\n"
        self.h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.h.wfile.flush()

    def _chunk(self, delta: dict | str, finish=None, usage=False) -> None:
        if self.opts.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        doc = dict(self.base, choices=[choice])
        if self.opts.include_usage:
            doc["usage"] = None
        self._write(json.dumps(doc).encode())

    def start(self) -> None:
        if not self.opts.stream or self.open:
            return
        h = self.h
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        self.open = True
        if self.opts.chat:
            self._chunk({"role": "assistant", "content": ""})

    def piece(self, text: str) -> None:
        if self.open and text:
            self._chunk({"content": text} if self.opts.chat else text)

    def end(self, finish: str, usage: dict) -> None:
        self.start()  # an answer without tokens still streams its end
        self._chunk({} if self.opts.chat else "", finish)
        if self.opts.include_usage:
            self._write(json.dumps(dict(self.base, choices=[], usage=usage)).encode())
        self._write(b"[DONE]")
        self._close(200)

    def fail(self, message: str) -> None:
        try:
            self._write(json.dumps({"error": {"message": message, "type": "server_error", "code": 503}}).encode())
            self._close(503)
        except OSError:
            pass
        self.h.close_connection = True

    def _close(self, status: int) -> None:
        self.h.wfile.write(b"0\r\n\r\n")
        self.h.wfile.flush()
        self.h.svc.metrics.requests.labels(endpoint(self.h.path), str(status)).inc()


class Server(ThreadingHTTPServer):
    request_queue_size = BACKLOG  # a burst of connections waits in the kernel instead of being reset
    daemon_threads = True


def make_server(svc: Service, host: str = "127.0.0.1", port: int = 8000) -> Server:
    handler = type("BoundHandler", (Handler,), {"svc": svc})
    return Server((host, port), handler)
