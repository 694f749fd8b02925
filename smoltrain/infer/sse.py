"""A streamed answer: server-sent events in HTTP chunks, in the OpenAI chunk format
(completions: `text`; chat: `delta`, the first chunk with the role; with
`stream_options.include_usage`, a last chunk with `usage`; then `data: [DONE]`)."""

from __future__ import annotations

import json

from smoltrain.infer.api import Options
from smoltrain.infer.metrics import endpoint


class Events:
    """Opened at the first token (an answer that fails before it is a plain JSON error)."""

    def __init__(self, h, rid: str, created: int, model: str, opts: Options):
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
