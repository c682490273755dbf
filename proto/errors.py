"""Typed errors both halves raise. The CLI prints them as one line, never a traceback.

Tested by: tests/datastore/test_corrupt.py, tests/datastore/cli/test_datastore_cli.py"""


class RedraftError(Exception):
    """Base of every error redraft reports to a user as a one-line message."""


class DatastoreError(RedraftError):
    """Anything wrong with a datastore, a corpus or a query."""


class DatastoreNotFound(DatastoreError):
    """The datastore path does not exist or holds no datastore."""


class DatastoreCorrupt(DatastoreError):
    """Wrong magic or format version, checksum mismatch, truncated or missing arrays."""


class TokenizerMismatch(DatastoreError):
    """A tokenizer whose fingerprint differs from the one the datastore was built with."""


class CorpusError(DatastoreError):
    """An input corpus is missing, unreadable, not text, or empty."""


class InvalidQuery(DatastoreError):
    """A query with out-of-range token ids, bad parameters or unknown corpora."""


class ModelNotFound(RedraftError):
    """A model or tokenizer name that resolves to nothing loadable."""
