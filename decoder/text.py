"""Text of a generation: chat messages to prompt ids, incremental detokenization, stop strings.

Decoding the whole output again at every step costs O(length) per step, O(length²) per
generation. `IncrementalText` decodes only the tokens since the previous step, with the
step before as left context (so tokenizers that drop or merge a word's leading space
see the same neighbours as a full decode), and holds back an incomplete multi-byte character
until its last byte arrives. `StopStrings` finds stop strings across step boundaries by
searching only what could still contain one, and holds back text that may be the start of
one, so a stream never shows text that the final result cuts.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalText:
    """Stable new text per step, decoding a bounded window of tokens each time."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._tokens: list[int] = []
        self._prefix = 0  # window start: the tokens before it are final text
        self._read = 0  # tokens up to here have been returned as text

    def push(self, tokens: Sequence[int]) -> str:
        """Append tokens; return the text they complete ("" while a character is split)."""
        self._tokens.extend(int(t) for t in tokens)
        window = self._tokens[self._prefix:]
        before = self._decode(window[: self._read - self._prefix])
        after = self._decode(window)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # a multi-byte character is split across tokens: wait for the rest
        self._prefix, self._read = self._read, len(self._tokens)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        window = self._tokens[self._prefix:]
        before = self._decode(window[: self._read - self._prefix])
        after = self._decode(window)
        self._prefix = self._read = len(self._tokens)
        return after[len(before):] if len(after) > len(before) else ""

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=self._skip) if tokens else ""


class StopStrings:
    """Cuts text at the first stop string, looking only at text that may still hold one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""  # a suffix of the text so far that begins some stop string
        self.stopped = False

    def feed(self, text: str) -> str:
        """New text in, the part of it that is safe to show out (everything before a stop)."""
        if self.stopped or not text:
            return ""
        buf = self._held + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return buf[: min(found)]
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(buf) + 1))
                    if buf.endswith(s[:k])), default=0)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, once no stop string can complete it (the generation ended)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def unencodable(text: str) -> str | None:
    """Why `text` cannot be tokenized, or None: a lone surrogate (from a JSON escape such as
    "\\ud800", or undecodable bytes Python carried over as surrogate escapes) has no UTF-8
    form, and tokenizers fail on it with an error that names neither the cause nor where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        if 0xDC80 <= bad <= 0xDCFF:  # how Python carries an undecodable byte
            return f"not valid UTF-8 (byte 0x{bad - 0xDC00:02x} at character {exc.start})"
        return f"not valid Unicode (a lone surrogate U+{bad:04X} at character {exc.start})"
    return None


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of chat messages through the tokenizer's chat template; with
    `add_generation_prompt`, ending where the assistant's answer starts."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]
