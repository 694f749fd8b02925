"""Chat messages to prompt ids, the way the checkpoint's own chat template lays them out.

An instruct model was trained on one exact layout (role headers, special tokens, the
assistant's opening), so `/v1/chat/completions` renders the checkpoint's Jinja
`chat_template` (`chat_template.jinja`, else `tokenizer_config.json`) as transformers'
`apply_chat_template(messages, add_generation_prompt=True)` does: a sandboxed Jinja
environment with trim_blocks and lstrip_blocks, its `raise_exception`, `tojson` and
`strftime_now`, the tokenizer's special tokens as variables, and the result tokenized
without adding special tokens (the template writes them). A checkpoint without a
template gets a plain `role: content` layout.

A template is code from the checkpoint, run on every chat request, so it runs on a budget:
RENDER_SECONDS of time (checked at every line the render executes, loops included) and
`max_chars` of output (checked as it is produced, and before a repeat, a power, a
format width or a padding argument could build something larger in one C call). Past
either, the request gets a 400 naming the limit and the server goes on.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from datetime import datetime

from smolnet.errors import SmolError

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
RENDER_SECONDS = 2.0  # a chat template's time per request
RENDER_CHARS = 4 << 20  # and its output (characters), unless the service sets its own
_WIDE = re.compile(r"\d{7,}")  # a format width of a million characters or more


class ChatError(SmolError):
    """Messages the template refuses (its raise_exception), or a template that does not render."""


class OverBudget(ChatError):
    """A template passed its time or output budget (the message names the limit)."""


def _result_check(limit: int, out):
    if isinstance(out, (str, list, tuple)) and len(out) > limit:
        raise OverBudget(f"the chat template's output is limited to {limit} characters")
    return out


def _replace_check(limit: int, s, old, new) -> None:
    """str.replace grows a string by (matches x new) in one C call: sized before it runs."""
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        grows = (len(s) + 1 if old == "" else s.count(old)) * len(new)
        if len(s) + grows > limit:
            raise OverBudget(f"the chat template's output is limited to {limit} characters")


def _size_check(limit: int, args) -> None:
    """Refuse an argument that would build more than `limit` characters in one C call: a width, a count."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > limit:
            raise OverBudget(f"the chat template's output is limited to {limit} characters (an argument of {a})")


def _format_check(limit: int, fmt) -> None:
    """A format string (`%` or str.format) with a width of a million characters or more."""
    if isinstance(fmt, str) and _WIDE.search(fmt) and ("%" in fmt or "{" in fmt):
        raise OverBudget(f"the chat template's output is limited to {limit} characters (a format width)")


def _sized(x) -> bool:
    return hasattr(x, "__len__")


def _render_trace(deadline: float, limit: int):
    """A trace function that stops the thread's Python code at `deadline` (each line, each call),
    and sizes the operands of Jinja's `~` (runtime.str_join/markup_join) before they are joined."""

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise OverBudget(f"the chat template ran past its time limit of {RENDER_SECONDS:g}s")
        if event == "call" and frame.f_code.co_name in ("str_join", "markup_join"):
            seq = frame.f_locals.get("seq")
            if isinstance(seq, (tuple, list)) and sum(len(x) for x in seq if isinstance(x, str)) > limit:
                raise OverBudget(f"the chat template's output is limited to {limit} characters")
        return trace

    return trace


def _token_text(v):
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _compile(template: str, limit: int):
    import functools
    import operator

    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendered as is.
        While `Chat.render_spans` renders, each marked text's character span is recorded (transformers'
        AssistantTracker: the offset is the length of the blocks yielded so far)."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.tracking = None  # (blocks rendered so far, spans) while render_spans runs
            environment.extend(generation=self)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            rv = caller()
            if self.tracking is not None:
                blocks, spans = self.tracking
                start = len("".join(blocks))
                spans.append((start, start + len(rv)))
            return rv

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Budgeted(ImmutableSandboxedEnvironment):
        """The sandbox, with every call and every repeat, power, format and concatenation sized first."""

        intercepted_binops = frozenset(["*", "**", "%", "+"])

        def call_binop(self, context, op, left, right):
            if op == "*" and isinstance(left, int) and not isinstance(left, bool):
                left, right = right, left  # n * 'x' as 'x' * n
            if op == "*" and hasattr(left, "__len__") and isinstance(right, int):
                if len(left) * right > limit:
                    raise OverBudget(f"the chat template's output is limited to {limit} characters")
            elif op == "**" and isinstance(left, int) and isinstance(right, int):
                if right > 64 and abs(left) > 1:
                    raise OverBudget(f"the chat template's numbers are limited (a power of {right})")
            elif op == "%":
                _format_check(limit, left)
            elif op == "+" and _sized(left) and _sized(right) and len(left) + len(right) > limit:
                raise OverBudget(f"the chat template's output is limited to {limit} characters")
            return {"*": operator.mul, "**": operator.pow, "%": operator.mod, "+": operator.add}[op](left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # jinja's own signature
            _size_check(limit, [*args, *kwargs.values()])
            if getattr(__obj, "__name__", "") == "replace" and len(args) >= 2:
                _replace_check(limit, getattr(__obj, "__self__", None), args[0], args[1])
            return _result_check(limit, super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):
            if getattr(value, "__name__", "") in ("format", "format_map"):
                _format_check(limit, getattr(value, "__self__", None))
            return super().wrap_str_format(value)

    class Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name, value):
            super().__setitem__(name, _result_check(limit, value))

    def sized(f):
        @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
        def g(*args, **kwargs):
            first = 2 if getattr(f, "jinja_pass_arg", None) else 1  # the value (after a context) is not sized
            _size_check(limit, [*args[first:], *kwargs.values()])
            if f.__name__ == "do_format" and args:
                _format_check(limit, args[0])
            if f.__name__ == "do_replace" and len(args) >= 4:
                _replace_check(limit, str(args[1]), args[2], args[3])
            return _result_check(limit, f(*args, **kwargs))

        return g

    env = Budgeted(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters = {k: sized(f) for k, f in env.filters.items()}
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["namespace"] = Namespace
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatError(f"the checkpoint's chat template does not parse: {e}") from None


class Chat:
    def __init__(self, model_dir: str, tokenizer, max_chars: int = RENDER_CHARS):
        self.tok, self.max_chars = tokenizer, max_chars
        cfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        self.special = {k: _token_text(cfg.get(k)) for k in SPECIAL if _token_text(cfg.get(k)) is not None}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        self.template = _compile(template, max_chars) if isinstance(template, str) and template.strip() else None
        self.template_text = template if self.template is not None else None
        self.source = "template" if self.template is not None else "plain"

    def render(self, messages: list[dict]) -> str:
        if self.template is None:
            return "".join(f"{m['role']}: {text_of(m)}\n" for m in messages) + "assistant:"
        import jinja2

        try:
            return self._render(messages)
        except OverBudget as e:
            raise ChatError(str(e)) from None
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"the chat template refused the messages: {e}") from None
        except Exception as e:  # a template is code from the checkpoint: its failure is the request's
            raise ChatError(f"the chat template failed: {type(e).__name__}: {e}") from None

    def render_spans(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        """The template's text for `messages` and the character spans its `{% generation %}` markers
        wrap (what transformers' `return_assistant_tokens_mask` maps to tokens); needs a template."""
        import jinja2

        tracker, blocks, spans = self.template.environment.generation, [], []
        tracker.tracking = (blocks, spans)
        try:
            kw = dict(messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt)
            for block in self.template.generate(**kw, **self.special):
                blocks.append(block)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"the chat template refused the messages: {e}") from None
        except Exception as e:  # a template is code from the checkpoint
            raise ChatError(f"the chat template failed: {type(e).__name__}: {e}") from None
        finally:
            tracker.tracking = None
        return "".join(blocks), spans

    def _render(self, messages: list[dict]) -> str:
        """The template's text, within its time and output budget."""
        kw = dict(messages=messages, tools=None, documents=None, add_generation_prompt=True, **self.special)
        before = sys.gettrace()
        sys.settrace(_render_trace(time.monotonic() + RENDER_SECONDS, self.max_chars))
        try:
            out, n = [], 0
            for piece in self.template.generate(**kw):
                n += len(piece)
                if n > self.max_chars:
                    raise OverBudget(f"the chat template's output is limited to {self.max_chars} characters")
                out.append(piece)
            return "".join(out)
        finally:
            sys.settrace(before)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.render(messages)
        if self.template is None:
            return self.tok.encode(text).ids
        return self.tok.encode(text, add_special_tokens=False).ids

    def stop_ids(self, model_dir: str, eos: int | None) -> list[int]:
        """Every end-of-sequence id the checkpoint names: config.json and generation_config.json
        (a list for instruct models: end of text and end of turn) and the tokenizer's eos_token."""
        ids = set() if eos is None else {eos}
        for name in ("config.json", "generation_config.json"):
            v = _read_json(os.path.join(model_dir, name)).get("eos_token_id")
            for i in v if isinstance(v, list) else [v]:
                if isinstance(i, int) and not isinstance(i, bool):
                    ids.add(i)
        if self.tok is not None and self.special.get("eos_token"):
            t = self.tok.token_to_id(self.special["eos_token"])
            if t is not None:
                ids.add(t)
        return sorted(ids)


def text_of(m: dict) -> str:
    """A message's text: its content string, or its text parts joined."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    return "".join(p["text"] for p in c or [])
