"""The datastore side: corpora -> suffix-array datastore (LMDB segments) -> exact lookups.

Storage and exact search live here (format, lmdbfile and its compiled maps `_mapping`,
segment, manifest, tiers, commit, corpus, build, reader); drafting over them in
`drafting/`, the gRPC draft service in `service/`, the commands in `cli/`.
"""

from redraft.datastore.build import (
    DEFAULT_SHARD_TOKENS,
    append_corpus,
    build_datastore,
    delete_documents,
    learned_marks,
    persist_learned,
)
from redraft.datastore.commit import DEFAULT_WAIT_S, CommitConflict, upgrade_datastore
from redraft.datastore.manifest import commit_stamp
from redraft.datastore.reader import Reader, ReaderClosed
from redraft.proto.errors import (
    CorpusError,
    DatastoreCorrupt,
    DatastoreError,
    DatastoreNotFound,
    InvalidQuery,
    ModelNotFound,
    RedraftError,
    TokenizerMismatch,
)

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "DEFAULT_WAIT_S",
    "CommitConflict",
    "CorpusError",
    "DatastoreCorrupt",
    "DatastoreError",
    "DatastoreNotFound",
    "InvalidQuery",
    "ModelNotFound",
    "Reader",
    "ReaderClosed",
    "RedraftError",
    "TokenizerMismatch",
    "append_corpus",
    "build_datastore",
    "commit_stamp",
    "delete_documents",
    "learned_marks",
    "persist_learned",
    "upgrade_datastore",
]
