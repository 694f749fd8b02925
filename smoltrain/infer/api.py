"""An OpenAI request body, checked field by field, into a Request the model can run.

Every number is range-checked before it reaches the model (NaN, Infinity, 1e999, a
seed of 2**70, max_tokens 0 or beyond the limit all get a 400 naming the field); the
JSON itself is parsed strictly (no NaN or Infinity literals). What the API does not
support (several choices, logprobs, echo, penalties) is refused, not ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from smolnet.errors import SmolError
from smoltrain.infer.batching import Request

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4
MAX_STOP_CHARS = 256
SEED_RANGE = (-(2**63), 2**63)


class BadRequest(SmolError):
    """A request the API refuses; `status` is the HTTP code of the JSON error, `kind` its type."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message, code=2)
        self.status, self.kind = status, kind


@dataclass
class Limits:
    max_body: int = 1 << 20  # bytes of JSON per request
    max_tokens: int = 4096  # the most one request may ask for (the context caps it too)
    max_prompt: int | None = None  # prompt tokens (--max-prompt-tokens; None: the model's context)


@dataclass
class Options:
    """What shapes the answer rather than the tokens."""

    chat: bool
    stream: bool = False
    include_usage: bool = False
    stops: list[str] = field(default_factory=list)


def parse_json(raw: bytes) -> dict:
    def constant(name):
        raise ValueError(f"{name} is not a JSON number")

    def number(text):
        x = float(text)
        if not math.isfinite(x):
            raise ValueError(f"{text} is out of range")
        return x

    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=constant, parse_float=number)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    try:  # a lone surrogate (\ud800) is valid JSON but no text: the tokenizer would fail on it
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("the body holds a lone surrogate (\\ud800-\\udfff): not text") from None
    return body


def _int(body: dict, key: str, lo: int, hi: int, default=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key} must be an integer, got {json.dumps(v)[:40]}")
    if not lo <= v <= hi:
        raise BadRequest(f"{key} must be between {lo} and {hi}, got {v}")
    return v


def _number(body: dict, key: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{key} must be a number, got {json.dumps(v)[:40]}")
    v = float(v)
    if not (math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi):
        raise BadRequest(f"{key} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}")
    return v


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be true or false")
    return v


def _stops(v) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("stop must be a string or a list of strings")
    if len(stops) > MAX_STOPS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"stop takes at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters")
    return stops


def _unsupported(body: dict) -> None:
    if _int(body, "n", 1, 2**31, 1) != 1 or _int(body, "best_of", 1, 2**31, 1) != 1:
        raise BadRequest("n and best_of above 1 are not supported (send several requests: they are batched)")
    for key in ("echo", "logprobs"):
        if body.get(key) not in (None, False, 0):
            raise BadRequest(f"{key} is not supported")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, -2.0, 2.0, 0.0) != 0.0:
            raise BadRequest(f"{key} is not supported (0 only)")
    if body.get("tools") or body.get("functions"):
        raise BadRequest("tools are not supported")


def check_messages(messages) -> list[dict]:
    ok = isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
    if not ok:
        raise BadRequest("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        c = m.get("content")
        parts_ok = isinstance(c, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c
        )
        if not isinstance(c, str) and not parts_ok:
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts")
    return messages


def request(body: dict, chat: bool, svc, limits: Limits) -> tuple[Request, Options]:
    """(Request, Options) from a checked body; svc gives the model: id, context, tokenizer, chat layout."""
    model = body.get("model")
    if model is not None and model != svc.model_id:
        raise BadRequest(f"the model {str(model)[:80]!r} does not exist (this server has {svc.model_id!r})", 404)
    _unsupported(body)
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or not stream):
        raise BadRequest("stream_options must be an object, and only with stream: true")
    opts = Options(chat, stream, _bool(so or {}, "include_usage"), _stops(body.get("stop")))
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True)
    seed = _int(body, "seed", SEED_RANGE[0], SEED_RANGE[1] - 1, 0)
    ids = svc.chat_ids(check_messages(body.get("messages"))) if chat else svc.encode(body.get("prompt"))
    if limits.max_prompt is not None and len(ids) > limits.max_prompt:
        raise BadRequest(
            f"the prompt is {len(ids)} tokens; this server takes at most {limits.max_prompt} (--max-prompt-tokens)"
        )
    room = svc.mc.ctx - len(ids)
    if room < 1:
        raise BadRequest(f"the prompt is {len(ids)} tokens; the model's context is {svc.mc.ctx}")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    cap = min(limits.max_tokens, room)
    default = min(cap, 16) if not chat else cap  # OpenAI: 16 for completions, the rest of the context for chat
    max_new = _int(body, key, 1, 2**63, default)
    if max_new > limits.max_tokens:
        raise BadRequest(f"{key} {max_new} is over this server's limit of {limits.max_tokens}")
    if max_new > room:
        raise BadRequest(f"prompt ({len(ids)} tokens) + {key} {max_new} exceed the context of {svc.mc.ctx}")
    stop_ids = [] if _bool(body, "ignore_eos") else list(svc.stop_ids)
    return Request(ids, max_new, temperature, top_p, seed % 2**64, stop_ids), opts
