"""The datastore side: corpora -> suffix-array datastore (LMDB) -> lookups and drafts."""

from redraft.datastore.build import (
    DEFAULT_SHARD_TOKENS,
    append_corpus,
    build_datastore,
    delete_documents,
)
from redraft.datastore.draft import PLD, REST, Draft
from redraft.datastore.errors import (
    CorpusError,
    DatastoreCorrupt,
    DatastoreError,
    DatastoreNotFound,
    InvalidQuery,
    ModelNotFound,
    RedraftError,
    TokenizerMismatch,
)
from redraft.datastore.reader import Reader

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "PLD",
    "REST",
    "CorpusError",
    "DatastoreCorrupt",
    "DatastoreError",
    "DatastoreNotFound",
    "Draft",
    "InvalidQuery",
    "ModelNotFound",
    "Reader",
    "RedraftError",
    "TokenizerMismatch",
    "append_corpus",
    "build_datastore",
    "delete_documents",
]
