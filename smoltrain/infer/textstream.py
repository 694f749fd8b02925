"""Token ids in, text out, a piece at a time: what a streamed answer sends.

Decoding token by token can cut a character in two (byte-level tokens split UTF-8), and
some tokenizers change a token's text with what follows it. So each new piece is the
text of the last few tokens decoded together, minus the part already sent, and is
held back while it ends in an unfinished character (U+FFFD). Stop strings are checked
on this text: a piece that could be the start of a stop string waits until it is
clearly not one; when one appears, the text ends before it. The pieces of a stream
joined are exactly the text a non-streamed answer carries (both come from here).
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str] | tuple = ()):
        self.tok, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.prefix = self.read = 0  # decode window: ids[prefix:read] is text already taken
        self.pending = ""  # decoded, not yet sent (could begin a stop string)
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self.tok is None:  # no tokenizer: the ids as text, as the API has always shown them
            return "".join(f" {i}" for i in ids)
        return self.tok.decode(ids, skip_special_tokens=True)

    def _new_text(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) > len(before) and (final or not now.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""

    def push(self, token: int) -> str:
        """The text that may be sent now that `token` arrived ('' while held back or after a stop)."""
        if self.stopped:
            return ""
        self.ids.append(token)
        self.pending += self._new_text(final=False)
        return self._release()

    def finish(self) -> str:
        """Whatever is left at the end of the answer."""
        if self.stopped:
            return ""
        self.pending += self._new_text(final=True)
        out = self._release()
        if not self.stopped:
            out, self.pending = out + self.pending, ""
        return out

    def _release(self) -> str:
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out
        keep = 0  # the longest tail that could still grow into a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if s.startswith(self.pending[-k:]):
                    keep = k
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out
