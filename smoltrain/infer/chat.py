"""Chat messages to prompt ids, the way the checkpoint's own chat template lays them out.

An instruct model was trained on one exact layout (role headers, special tokens, the
assistant's opening), so `/v1/chat/completions` renders the checkpoint's Jinja
`chat_template` (`chat_template.jinja`, else `tokenizer_config.json`) as transformers'
`apply_chat_template(messages, add_generation_prompt=True)` does: a sandboxed Jinja
environment with trim_blocks and lstrip_blocks, its `raise_exception`, `tojson` and
`strftime_now`, the tokenizer's special tokens as variables, and the result tokenized
without adding special tokens (the template writes them). A checkpoint without a
template gets a plain `role: content` layout.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from smolnet.errors import SmolError

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatError(SmolError):
    """Messages the template refuses (its raise_exception), or a template that does not render."""


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


def _compile(template: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatError(f"the checkpoint's chat template does not parse: {e}") from None


class Chat:
    def __init__(self, model_dir: str, tokenizer):
        self.tok = tokenizer
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
        self.template = _compile(template) if isinstance(template, str) and template.strip() else None
        self.source = "template" if self.template is not None else "plain"

    def render(self, messages: list[dict]) -> str:
        if self.template is None:
            return "".join(f"{m['role']}: {text_of(m)}\n" for m in messages) + "assistant:"
        import jinja2

        try:
            return self.template.render(
                messages=messages, tools=None, documents=None, add_generation_prompt=True, **self.special
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"the chat template refused the messages: {e}") from None
        except Exception as e:  # a template is code from the checkpoint: its failure is the request's
            raise ChatError(f"the chat template failed: {type(e).__name__}: {e}") from None

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
