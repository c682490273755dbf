from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Source(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_UNSPECIFIED: _ClassVar[Source]
    SOURCE_REST: _ClassVar[Source]
    SOURCE_PLD: _ClassVar[Source]
    SOURCE_LEARNED: _ClassVar[Source]
SOURCE_UNSPECIFIED: Source
SOURCE_REST: Source
SOURCE_PLD: Source
SOURCE_LEARNED: Source

class DraftParams(_message.Message):
    __slots__ = ("budget", "max_depth", "sources", "corpora", "min_match_len", "max_match_len")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    CORPORA_FIELD_NUMBER: _ClassVar[int]
    MIN_MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    budget: int
    max_depth: int
    sources: _containers.RepeatedScalarFieldContainer[Source]
    corpora: _containers.RepeatedScalarFieldContainer[str]
    min_match_len: int
    max_match_len: int
    def __init__(self, budget: _Optional[int] = ..., max_depth: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[Source, str]]] = ..., corpora: _Optional[_Iterable[str]] = ..., min_match_len: _Optional[int] = ..., max_match_len: _Optional[int] = ...) -> None: ...

class Tree(_message.Message):
    __slots__ = ("tokens", "parents", "probs", "sources")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    sources: _containers.RepeatedScalarFieldContainer[Source]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ..., sources: _Optional[_Iterable[_Union[Source, str]]] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("tree", "match_len", "expected_accepted", "pld_match_len", "learned_match_len")
    TREE_FIELD_NUMBER: _ClassVar[int]
    MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PLD_MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    LEARNED_MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    tree: Tree
    match_len: int
    expected_accepted: float
    pld_match_len: int
    learned_match_len: int
    def __init__(self, tree: _Optional[_Union[Tree, _Mapping]] = ..., match_len: _Optional[int] = ..., expected_accepted: _Optional[float] = ..., pld_match_len: _Optional[int] = ..., learned_match_len: _Optional[int] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("prompt", "params", "tokenizer_fingerprint", "tenant")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    prompt: _containers.RepeatedScalarFieldContainer[int]
    params: DraftParams
    tokenizer_fingerprint: str
    tenant: str
    def __init__(self, prompt: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[DraftParams, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class SessionStep(_message.Message):
    __slots__ = ("accepted", "budget")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    budget: int
    def __init__(self, accepted: _Optional[_Iterable[int]] = ..., budget: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "step")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    step: SessionStep
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., step: _Optional[_Union[SessionStep, _Mapping]] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("draft", "session_id", "context_len")
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    draft: DraftReply
    session_id: str
    context_len: int
    def __init__(self, draft: _Optional[_Union[DraftReply, _Mapping]] = ..., session_id: _Optional[str] = ..., context_len: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("context", "params", "tokenizer_fingerprint", "tenant")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    context: _containers.RepeatedScalarFieldContainer[int]
    params: DraftParams
    tokenizer_fingerprint: str
    tenant: str
    def __init__(self, context: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[DraftParams, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Corpus(_message.Message):
    __slots__ = ("name", "n_docs", "n_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    N_DOCS_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    n_docs: int
    n_tokens: int
    def __init__(self, name: _Optional[str] = ..., n_docs: _Optional[int] = ..., n_tokens: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_context_len", "max_budget", "max_sessions", "idle_timeout_s", "max_message_bytes")
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_context_len: int
    max_budget: int
    max_sessions: int
    idle_timeout_s: int
    max_message_bytes: int
    def __init__(self, max_context_len: _Optional[int] = ..., max_budget: _Optional[int] = ..., max_sessions: _Optional[int] = ..., idle_timeout_s: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("tokenizer_fingerprint", "tokenizer_name", "vocab_size", "n_tokens", "n_docs", "n_shards", "corpora", "format_version", "manifest_json", "limits", "learn")
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_DOCS_FIELD_NUMBER: _ClassVar[int]
    N_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CORPORA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    LEARN_FIELD_NUMBER: _ClassVar[int]
    tokenizer_fingerprint: str
    tokenizer_name: str
    vocab_size: int
    n_tokens: int
    n_docs: int
    n_shards: int
    corpora: _containers.RepeatedCompositeFieldContainer[Corpus]
    format_version: int
    manifest_json: str
    limits: Limits
    learn: str
    def __init__(self, tokenizer_fingerprint: _Optional[str] = ..., tokenizer_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., n_tokens: _Optional[int] = ..., n_docs: _Optional[int] = ..., n_shards: _Optional[int] = ..., corpora: _Optional[_Iterable[_Union[Corpus, _Mapping]]] = ..., format_version: _Optional[int] = ..., manifest_json: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., learn: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("requests", "sessions_opened", "sessions_active", "errors", "hits", "latency_p50_us", "latency_p99_us", "uptime_s", "stats_json")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_OPENED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P50_US_FIELD_NUMBER: _ClassVar[int]
    LATENCY_P99_US_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    requests: int
    sessions_opened: int
    sessions_active: int
    errors: int
    hits: int
    latency_p50_us: float
    latency_p99_us: float
    uptime_s: float
    stats_json: str
    def __init__(self, requests: _Optional[int] = ..., sessions_opened: _Optional[int] = ..., sessions_active: _Optional[int] = ..., errors: _Optional[int] = ..., hits: _Optional[int] = ..., latency_p50_us: _Optional[float] = ..., latency_p99_us: _Optional[float] = ..., uptime_s: _Optional[float] = ..., stats_json: _Optional[str] = ...) -> None: ...

class SequenceClose(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, accepted: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchEntry(_message.Message):
    __slots__ = ("sequence", "open", "step", "close")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    sequence: str
    open: SessionOpen
    step: SessionStep
    close: SequenceClose
    def __init__(self, sequence: _Optional[str] = ..., open: _Optional[_Union[SessionOpen, _Mapping]] = ..., step: _Optional[_Union[SessionStep, _Mapping]] = ..., close: _Optional[_Union[SequenceClose, _Mapping]] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("client", "entries", "params", "tokenizer_fingerprint", "tenant", "chain", "steps")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    client: str
    entries: _containers.RepeatedCompositeFieldContainer[BatchEntry]
    params: DraftParams
    tokenizer_fingerprint: str
    tenant: str
    chain: int
    steps: PackedSteps
    def __init__(self, client: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[BatchEntry, _Mapping]]] = ..., params: _Optional[_Union[DraftParams, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., tenant: _Optional[str] = ..., chain: _Optional[int] = ..., steps: _Optional[_Union[PackedSteps, _Mapping]] = ...) -> None: ...

class PackedSteps(_message.Message):
    __slots__ = ("sequences", "accepted", "counts", "budgets")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedScalarFieldContainer[str]
    accepted: bytes
    counts: bytes
    budgets: bytes
    def __init__(self, sequences: _Optional[_Iterable[str]] = ..., accepted: _Optional[bytes] = ..., counts: _Optional[bytes] = ..., budgets: _Optional[bytes] = ...) -> None: ...

class PackedResults(_message.Message):
    __slots__ = ("nodes", "context_lens", "match_lens", "expected_accepted", "failed", "failed_codes", "failed_messages")
    NODES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENS_FIELD_NUMBER: _ClassVar[int]
    MATCH_LENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILED_CODES_FIELD_NUMBER: _ClassVar[int]
    FAILED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    nodes: bytes
    context_lens: bytes
    match_lens: bytes
    expected_accepted: bytes
    failed: _containers.RepeatedScalarFieldContainer[int]
    failed_codes: _containers.RepeatedScalarFieldContainer[int]
    failed_messages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, nodes: _Optional[bytes] = ..., context_lens: _Optional[bytes] = ..., match_lens: _Optional[bytes] = ..., expected_accepted: _Optional[bytes] = ..., failed: _Optional[_Iterable[int]] = ..., failed_codes: _Optional[_Iterable[int]] = ..., failed_messages: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchResult(_message.Message):
    __slots__ = ("sequence", "code", "message", "nodes", "context_len", "match_len", "expected_accepted", "pld_match_len", "learned_match_len")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PLD_MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    LEARNED_MATCH_LEN_FIELD_NUMBER: _ClassVar[int]
    sequence: str
    code: int
    message: str
    nodes: int
    context_len: int
    match_len: int
    expected_accepted: float
    pld_match_len: int
    learned_match_len: int
    def __init__(self, sequence: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., nodes: _Optional[int] = ..., context_len: _Optional[int] = ..., match_len: _Optional[int] = ..., expected_accepted: _Optional[float] = ..., pld_match_len: _Optional[int] = ..., learned_match_len: _Optional[int] = ...) -> None: ...

class PackedTrees(_message.Message):
    __slots__ = ("tokens", "parents", "probs", "sources")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    parents: bytes
    probs: bytes
    sources: bytes
    def __init__(self, tokens: _Optional[bytes] = ..., parents: _Optional[bytes] = ..., probs: _Optional[bytes] = ..., sources: _Optional[bytes] = ...) -> None: ...

class BatchReply(_message.Message):
    __slots__ = ("results", "trees", "server_us", "steps")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    SERVER_US_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[BatchResult]
    trees: PackedTrees
    server_us: float
    steps: PackedResults
    def __init__(self, results: _Optional[_Iterable[_Union[BatchResult, _Mapping]]] = ..., trees: _Optional[_Union[PackedTrees, _Mapping]] = ..., server_us: _Optional[float] = ..., steps: _Optional[_Union[PackedResults, _Mapping]] = ...) -> None: ...
