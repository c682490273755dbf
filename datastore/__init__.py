"""The datastore side: corpora -> suffix-array datastore (LMDB) -> exact lookups.

Storage and exact search live here (format, lmdbfile, corpus, build, reader); drafting over
them in `drafting/`, the gRPC draft service in `service/`, the commands in `cli/`.
"""

from redraft.datastore.build import (
    DEFAULT_SHARD_TOKENS,
    append_corpus,
    build_datastore,
    delete_documents,
)
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
    "delete_documents",
]
