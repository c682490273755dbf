"""Training data for Medusa heads: chat records the target answered itself, as token ids, the
held-out split, and the answer positions with the labels each head learns.

Tested by: tests/decoder/heads/test_heads.py
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from redraft.decoder.text import chat_ids
from redraft.proto.errors import RedraftError
from redraft.proto.files import read_input
from redraft.proto.jsonl import parse_record


class TrainingError(RedraftError):
    """Bad training input: unreadable data, records without an assistant answer, bad sizes."""


@dataclass
class Document:
    name: str  # file:line
    ids: list[int]  # the whole chat, template applied
    start: int  # index of the first answer token
    end: int  # one past the answer's last token (its end-of-turn token included)

    @property
    def positions(self) -> int:
        """Hidden states used: those of the tokens start-1 .. end-2 (each predicts an answer
        token with the LM head; the heads predict the ones after it)."""
        return self.end - self.start


# -- data ------------------------------------------------------------------------------------


def read_documents(paths: Sequence[str], tokenizer) -> tuple[list[Document], str]:
    """Chat records (`messages` ending with the assistant's answer) -> documents + digest.

    The digest hashes the files' bytes: it names the hidden-state cache and is recorded in
    the heads file.
    """
    end_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    digest = hashlib.sha256()
    docs: list[Document] = []
    for path in paths:
        try:
            data = read_input(path)
        except OSError as exc:
            raise TrainingError(f"cannot read {path}: {exc.strerror or exc}") from None
        digest.update(hashlib.sha256(data).digest())
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise TrainingError(f"{path}: not UTF-8 text") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            rec = parse_record(line, f"{path}:{n}", TrainingError)
            try:
                messages = rec["messages"]
                ok = (isinstance(messages, list) and len(messages) >= 2
                      and all(isinstance(m.get("content"), str) for m in messages)
                      and messages[-1].get("role") == "assistant")
            except (ValueError, KeyError, TypeError, AttributeError):
                ok = False
            if not ok:
                raise TrainingError(f"{path}:{n}: needs a 'messages' list ending with the "
                                    "assistant's answer")
            prompt = chat_ids(tokenizer, messages[:-1], True)
            ids = chat_ids(tokenizer, messages, False)
            if ids[: len(prompt)] != prompt:
                raise TrainingError(f"{path}:{n}: the chat template does not extend the prompt")
            end = len(ids)
            while end > len(prompt) and ids[end - 1] not in end_ids:
                end -= 1  # drop what the template adds after the end-of-turn token
            if end - len(prompt) >= 2:
                docs.append(Document(f"{Path(path).name}:{n}", ids[:end], len(prompt), end))
    if not docs:
        raise TrainingError("no training documents in " + ", ".join(map(str, paths)))
    return docs, "sha256:" + digest.hexdigest()[:32]


def split_held_out(docs: Sequence[Document], percent: float) -> tuple[list[int], list[int]]:
    """Document indices (train, held-out), decided by a hash of each document's name."""
    train, held = [], []
    for i, d in enumerate(docs):
        h = int.from_bytes(hashlib.sha256(d.name.encode()).digest()[:4], "little")
        (held if h % 10_000 < percent * 100 else train).append(i)
    return train, held


@dataclass
class Positions:
    """Answer positions of some documents: the next token of each, and how many follow."""

    next_tokens: np.ndarray  # [N] the token the LM head predicts from this hidden state
    remaining: np.ndarray  # [N] answer tokens from next_tokens[i] to the document's end

    @classmethod
    def of(cls, docs: Sequence[Document]) -> Positions:
        toks = [np.asarray(d.ids[d.start : d.end], dtype=np.int64) for d in docs]
        rem = [np.arange(d.positions, 0, -1, dtype=np.int64) for d in docs]
        return cls(np.concatenate(toks), np.concatenate(rem))

    def __len__(self) -> int:
        return len(self.next_tokens)

    def labels(self, rows: np.ndarray, num_heads: int) -> np.ndarray:
        """[len(rows), K] label of head k (the token k places after the next), -1 if none."""
        k = np.arange(1, num_heads + 1)
        idx = rows[:, None] + k[None, :]
        valid = k[None, :] < self.remaining[rows][:, None]
        out = np.full(idx.shape, -1, dtype=np.int64)
        out[valid] = self.next_tokens[idx[valid]]
        return out


def frequency_subset(positions: Positions, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` token ids the model emits most often (ties by id), most frequent first."""
    counts = np.bincount(positions.next_tokens, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    return torch.from_numpy(order[: min(size, vocab_size)].copy())
