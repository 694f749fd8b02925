"""The OpenAI HTTP API in front of the model's replicas, on the standard library's threading server.

POST /v1/completions and /v1/chat/completions (with "stream": true as server-sent
events), GET /v1/models, GET /health, GET /metrics. Requests are batched by the model
(continuous batching, `batching.py`), so many are answered at once; past the batch,
up to `max_queue` wait for a slot and the rest get 429 at once. Every answer that is
not a success is a JSON error with a 4xx/5xx status: a bad field, a wrong API key, a
body too large, a model that is down. A client that goes away frees its slot at the
next step; connections are capped and each request has a deadline (conns.py).

Before anything else a request must name this server: on a loopback address the Host
header must be a loopback name (a DNS-rebinding page names its own), and a browser's
cross-origin request (an Origin that is not this server) is refused, so a web page cannot
drive the model. A request is admitted (the queue limit, 429) before its body is
tokenized or its chat template rendered. `/health` says ok or dead to anyone and the
details (errors with log tails, host names) only to a client with the key. Every log
line a client can put text in is escaped.
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import queue
import re
import resource
import select
import socket
import time
import uuid
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from smolnet.errors import UsageError
from smoltrain.infer.api import BadRequest, Options, parse_json, request
from smoltrain.infer.conns import DeadlineReader, Server
from smoltrain.infer.metrics import CONTENT_TYPE, endpoint
from smoltrain.infer.runner import RankDied, RequestFailed
from smoltrain.infer.service import Service
from smoltrain.infer.sse import Events
from smoltrain.infer.textstream import TextStream

_UNPRINTABLE = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160))}
_LENGTH = re.compile(r"[0-9]{1,15}")


def clean(text: str, limit: int = 400) -> str:
    """A client's text for a log line: control characters (ANSI, newlines) escaped, and cut short."""
    text = str(text)
    return text[:limit].translate(_UNPRINTABLE) + ("..." if len(text) > limit else "")


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """A non-loopback address serves the LAN (phones, guests): only with a key."""
    if not is_loopback(host) and not api_key:
        raise UsageError(
            f"--host {host or '0.0.0.0'} serves other machines: give a key "
            "(--api-key-file FILE or SMOL_API_KEY), or listen on 127.0.0.1"
        )


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    svc: Service

    def setup(self):
        self.timeout = self.svc.read_timeout  # each write's limit; reads have the request's deadline
        super().setup()
        self.deadline = time.monotonic() + self.svc.read_timeout
        self.rfile = io.BufferedReader(DeadlineReader(self.connection, self), 1 << 16)

    def handle_one_request(self):
        """Every request (the first, and each on a kept-alive connection) must arrive whole within
        read_timeout of its start; meanwhile the connection is one a newcomer may evict."""
        self.deadline = time.monotonic() + self.svc.read_timeout
        self.server.mark(self.connection, arriving=True)
        super().handle_one_request()

    def _arrived(self) -> None:
        """The request is in: answer it, with the write timeout on the socket again."""
        self.server.mark(self.connection, arriving=False)
        self.connection.settimeout(self.svc.read_timeout)

    def handle(self):
        try:
            super().handle()
        except OSError:  # the client reset or vanished between requests: nothing to answer
            self.close_connection = True

    def log_message(self, fmt, *args):  # one line per request on stderr, escaped: a client wrote it
        self.svc.log(clean(f"{self.address_string()} {fmt % args}"))

    def _send(self, status: int, data: bytes, ctype: str) -> None:
        self.connection.settimeout(self.svc.read_timeout)  # a write's limit, whatever the read left
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

    def _has_key(self) -> bool:
        key = self.svc.api_key
        got = self.headers.get("Authorization", "")
        return key is None or hmac.compare_digest(got.encode("utf-8", "replace"), f"Bearer {key}".encode())

    def _authorized(self) -> bool:
        if self._has_key():
            return True
        self._error(401, "a valid API key is needed: Authorization: Bearer KEY", "authentication_error")
        return False

    def _same_site(self) -> bool:
        """Host names this server (on loopback: a loopback name, against DNS rebinding) and an
        Origin, if any, is this server (a browser's cross-origin request is refused)."""
        host = self.headers.get("Host")
        loopback = is_loopback(self.server.server_address[0])
        if host is not None and loopback and not is_loopback(_host_name(host)):
            self._error(403, f"Host {clean(host, 80)!r} is not this server's (a loopback name is)", "forbidden")
            return False
        origin = self.headers.get("Origin")
        if origin is not None:
            o = urlsplit(origin)
            ok = o.scheme in ("http", "https") and (
                is_loopback(_host_name(o.netloc)) if loopback else o.netloc == (host or "")
            )
            if not ok:
                self._error(403, f"cross-origin requests are refused (Origin {clean(origin, 80)!r})", "forbidden")
                return False
        return True

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
            if self._same_site():
                answer()
            else:
                self.close_connection = True  # its body, if any, is unread: nothing more on this connection
        except (OSError, TimeoutError):  # the client went away or stalled: nothing left to answer
            self.close_connection = True
        except Exception as e:  # a bug must not take the handler (or the server) down: say so, log it
            self.svc.log(clean(f"error: {type(e).__name__}: {e} answering {self.path}"))
            self.close_connection = True
            try:
                self._error(500, f"internal error: {type(e).__name__}", "server_error")
            except OSError:
                pass

    def _get(self):
        self._arrived()
        path = self.path.split("?")[0]
        if path == "/health":  # the details (errors with log tails and host names) only with the key
            dead, alive = self.svc.router.dead, self.svc.router.alive()
            doc = {"status": "dead" if dead else "ok"}
            if self._has_key():
                doc.update(error=dead, replicas=len(self.svc.router.runners), alive=alive, served=self.svc.served)
                doc.update(disconnects=self.svc.disconnects)
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
        lengths = self.headers.get_all("Content-Length") or []
        self.unread = 0
        if len(lengths) > 1 or (lengths and not _LENGTH.fullmatch(lengths[0].strip())):
            self.close_connection = True  # where the body ends is unknown: nothing more is read
            return self._error(400, "Content-Length must be one non-negative decimal number")
        self.unread = int(lengths[0]) if lengths else 0
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
        path = self.path.split("?")[0]
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return self._error(404, f"no such endpoint: POST {clean(path, 80)}")
        if not self._authorized():
            return
        if self.svc.router.dead:
            return self._error(503, f"the model is down: {self.svc.router.dead}", "server_error")
        if not self.svc.enter():  # admission first: no body is tokenized past the queue limit
            return self._error(429, f"the server is full ({self.svc.open} requests open); retry later", "rate_limit")
        try:
            req, opts = self._read_request(path == "/v1/chat/completions")
        except BadRequest as e:
            self.svc.left(None, False)
            return self._error(e.status, str(e), e.kind)
        except BaseException:
            self.svc.left(None, False)
            raise
        self._complete(req, opts)

    def _read_request(self, chat: bool):
        if self.headers.get("Transfer-Encoding"):
            raise BadRequest("send the body with a Content-Length (chunked bodies are not accepted)", 411)
        n = self.unread
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
            self._arrived()
            raise BadRequest(f"the request did not arrive within {self.svc.read_timeout:g}s", 408) from None
        self._arrived()
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
        except RequestFailed as e:
            svc.left(None, False)
            return self._error(500, f"the request failed: {e}", "server_error")
        m.prompt_tokens.inc(len(req.prompt_ids))
        text, ids = TextStream(svc.tok, opts.stops), []
        out: list[str] = []
        finish, error, failed, last = None, None, False, t0
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
                    finish, error, failed = {"length": "length"}.get(ev[1], "stop"), ev[2], ev[1] == "error"
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
            status, why = (500, "the request failed") if failed else (503, "the model is down")
            if sse.open:
                return sse.fail(f"{why}: {error}")
            return self._error(status, f"{why}: {error}", "server_error")
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


def _host_name(netloc: str) -> str:
    """The name in a Host header or an Origin's netloc, without its port (IPv6 without brackets)."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:].split("]")[0]
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


def make_server(svc: Service, host: str = "127.0.0.1", port: int = 8000, max_connections: int = 256) -> Server:
    """The HTTP server, its connections capped below what this process may open (EMFILE)."""
    check_bind(host, svc.api_key)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cap = max_connections if soft == resource.RLIM_INFINITY else min(max_connections, max(8, soft // 2))
    handler = type("BoundHandler", (Handler,), {"svc": svc})
    server = Server((host, port), handler, max_connections=cap)
    server.handle_error = lambda request, addr: svc.log(_error_line(addr))
    svc.metrics.connections.set_function(server.open_connections)
    svc.metrics.shed.set_function(lambda: server.shed)
    return server


def _error_line(addr) -> str:
    """One line in the log instead of the standard library's traceback."""
    import sys

    e = sys.exc_info()[1]
    return clean(f"error: connection from {addr[0]}: {type(e).__name__}: {e}")
