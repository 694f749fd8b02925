"""What the HTTP handlers share: the replicas (a Router), the tokenizer and chat layout, the
limits, the metrics, and the count of open requests that the queue limit (429) is kept by."""

from __future__ import annotations

import sys
import threading

from smoltrain.infer.api import BadRequest, Limits
from smoltrain.infer.chat import RENDER_CHARS, Chat, ChatError
from smoltrain.infer.metrics import Metrics


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
        limits = limits or Limits()
        chars = max(RENDER_CHARS, 2 * limits.max_body)  # a template's output: room for the body and its layout
        self.chat = Chat(model_dir, tokenizer, chars) if model_dir and tokenizer is not None else None
        self.stop_ids = self.chat.stop_ids(model_dir, mc.eos) if self.chat else ([] if mc.eos is None else [mc.eos])
        self.max_batch, self.max_queue = max_batch, max_queue
        self.limits, self.api_key, self.read_timeout = limits, api_key, read_timeout
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
        if any(not 0 <= i < self.mc.vocab for i in ids):  # a tokenizer larger than the model's embedding
            raise BadRequest(f"the chat template gives a token id outside the vocabulary (0..{self.mc.vocab - 1})")
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
