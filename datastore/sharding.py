"""From documents to shards: tokenizing in batches, checking the ids, and the rule that cuts
documents into shards.

Both builds use these, the single-process one (build.py) and the one on a Ray cluster
(ray_build.py), so that they cut the same shards from the same documents: byte-identical
shard arrays, whoever sorts them.

Tested by: tests/datastore/test_build.py
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
from redraft.datastore import format as fmt
from redraft.datastore.corpus import Document
from redraft.proto.errors import CorpusError

BATCH_CHARS = 2 << 20  # text per tokenizer batch: big enough to keep every core busy
EMPTY_CORPUS = "empty corpus: the inputs hold no text"


def _batches(docs: Iterable[Document], batch_chars: int) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for d in docs:
        batch.append(d)
        size += len(d.text)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenize_documents(docs: Iterable[Document], tokenizer, *, batch_chars: int = BATCH_CHARS,
                       progress=None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, token ids) per document, encoding in batches on all cores.

    `tokenizer`: a Hugging Face tokenizer (its fast backend encodes when it has one) or a
    `tokenizers.Tokenizer` itself (what a Ray task receives: no model files needed)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "encode_batch"):
        backend = tokenizer
    for batch in _batches(docs, batch_chars):
        texts = [d.text for d in batch]
        if backend is not None:
            ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        else:
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for d, seq in zip(batch, ids):
            if progress is not None:
                progress.update(len(d.text))
            yield d.name, np.asarray(seq, dtype=np.int64)


def check_ids(name: str, ids: np.ndarray, vocab: int) -> np.ndarray:
    """`ids` unchanged if they are a flat sequence of ids of the vocabulary, else CorpusError."""
    if ids.ndim != 1:
        raise CorpusError(f"{name}: token ids must be a flat sequence")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise CorpusError(f"{name}: token id {bad} outside the vocabulary [0, {vocab})")
    return ids


def shard_limit(shard_tokens: int, segment_tokens: int) -> int:
    """The most tokens (separators included) a shard may hold: a shard never spans two
    segment files, and its offsets fit uint32."""
    return max(1, min(int(shard_tokens), int(segment_tokens), fmt.MAX_SHARD_LEN))


class ShardCutter:
    """Where shards end, documents taken in order: a shard closes before the document that
    would overflow it (a document alone may fill a shard up to MAX_SHARD_LEN)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0  # tokens of the open shard, a separator after each document

    def closes_before(self, name: str, n_tokens: int) -> bool:
        """Take a (non-empty) document of `n_tokens`; whether the open shard closes before it."""
        if n_tokens + 1 > fmt.MAX_SHARD_LEN:
            raise CorpusError(f"{name}: document of {n_tokens:,} tokens exceeds a shard")
        close = self.size > 0 and self.size + n_tokens + 1 > self.limit
        if close:
            self.size = 0
        self.size += n_tokens + 1
        return close
