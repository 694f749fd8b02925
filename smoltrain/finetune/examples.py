"""One training example as token ids and a loss mask, tokenized the way the reference tools do.

- Chats (`{"messages": [...]}`) are rendered with the checkpoint's chat template and tokenized
  without added special tokens, as transformers' `apply_chat_template(..., tokenize=True,
  return_assistant_tokens_mask=True)` does. Where the template marks the assistant's text with
  `{% generation %}`, the mask is transformers' `assistant_masks`: the marked character spans
  mapped to tokens with `char_to_token`. Where it has no markers, each assistant turn is what
  rendering the turn adds after the conversation so far with the generation prompt (TRL's
  prompt/completion convention applied turn by turn), mapped to tokens the same way; a template
  that rewrites earlier turns cannot be split like that and is refused.
- Pairs (`{"prompt", "completion"}`) follow TRL's SFTTrainer: the loss is on the tokens after the
  separately tokenized prompt; plain text gets EOS appended to the completion, and chat-style
  pairs (lists of messages) render the prompt with the generation prompt.
- Text documents are tokenized with the tokenizer's own special tokens and followed by EOS.
"""

from __future__ import annotations

import re

from smolnet.errors import UsageError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class DataError(UsageError):
    """Training data that cannot be used: named by file and line, exit 2."""


class Tokenizing:
    """The checkpoint's tokenizer, chat template and end-of-sequence id, for making examples."""

    def __init__(self, model_dir: str, tokenizer, eos: int | None):
        from smoltrain.infer.chat import Chat

        self.tok, self.chat = tokenizer, Chat(model_dir, tokenizer)
        self.model_dir = model_dir
        token = self.chat.special.get("eos_token")
        self.eos_text = token
        self.eos = tokenizer.token_to_id(token) if token else None
        if self.eos is None:
            self.eos = eos
        self.marked = bool(GENERATION_TAG.search(self.chat.template_text or ""))

    def texts(self, docs: list[str]) -> list[list[int]]:
        """Each document's ids (the tokenizer's own special tokens) followed by EOS."""
        if self.eos is None:
            raise DataError(f"{self.model_dir} names no end-of-sequence token: text documents cannot be separated")
        return [e.ids + [self.eos] for e in self.tok.encode_batch(docs)]

    def _need_template(self):
        if self.chat.template is None:
            raise DataError(
                f"{self.model_dir} has no chat template (tokenizer_config.json `chat_template` or "
                "chat_template.jinja): chat data needs one"
            )

    def chat_example(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(ids, mask) of a conversation, the mask 1 on the assistant's tokens."""
        self._need_template()
        messages = plain(messages)
        text, spans = self.chat.render_spans(messages, add_generation_prompt=False)
        if not self.marked:
            spans = self._turn_spans(messages, text)
        enc = self.tok.encode(text, add_special_tokens=False)
        ids = enc.ids
        mask = [0] * len(ids)
        for start, end in spans:  # transformers' mapping, quirks included
            first, last = enc.char_to_token(start), enc.char_to_token(end - 1)
            if first is None:
                break
            for t in range(first, last + 1 if last else len(ids)):
                mask[t] = 1
        return ids, mask

    def _turn_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before, _ = self.chat.render_spans(messages[:i], add_generation_prompt=True)
            upto, _ = self.chat.render_spans(messages[: i + 1], add_generation_prompt=False)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise DataError(
                    "the chat template does not render the conversation turn by turn (a later turn changes "
                    "earlier text), so the assistant's tokens cannot be found: add {% generation %} markers to it"
                )
            if len(upto) > len(before):
                spans.append((len(before), len(upto)))
        return spans

    def pair_example(self, prompt, completion) -> tuple[list[int], list[int]]:
        """(ids, mask) of a prompt and its completion, the mask 1 after the prompt's tokens (TRL)."""
        if isinstance(prompt, str):
            if self.eos_text and not completion.endswith(self.eos_text):
                completion = completion + self.eos_text
            head = self.tok.encode(prompt).ids
            ids = self.tok.encode(prompt + completion).ids
        else:
            self._need_template()
            prompt, completion = plain(prompt), plain(completion)
            head = self.tok.encode(self.chat.render_spans(prompt, True)[0], add_special_tokens=False).ids
            whole = self.chat.render_spans(prompt + completion, False)[0]
            ids = self.tok.encode(whole, add_special_tokens=False).ids
        n = min(len(head), len(ids))
        return ids, [0] * n + [1] * (len(ids) - n)


REASONING = ("reasoning_content", "thinking", "reasoning")


def plain(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None dropped, and a
    message's reasoning (under any of its names) also as `thinking` and `reasoning_content`."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out
