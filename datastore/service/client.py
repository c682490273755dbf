"""The Python client of the draft service, as the decoder uses it.

Why a class of our own over the raw stubs: a decoder must never hang or crash because a
draft server is slow or gone. Every call has a deadline, a session step too (a watchdog
cancels a step that overruns), failures surface as a few typed errors (so the decoder can
fall back to local drafting), and a session whose server restarted is reopened with the
context the client kept, once, transparently.

    client = DraftClient("127.0.0.1:50051", token=None, timeout=2.0)
    # or replicas: DraftClient("10.0.0.1:50051,10.0.0.2:50051"), DraftClient("dns:///drafts:50051")
    info = client.info()
    with client.session(prompt_ids, DraftParams(budget=32), info.tokenizer_fingerprint) as s:
        draft = s.draft                 # for the prompt
        draft = s.step(accepted_ids)    # after each verification
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from redraft.proto import draft_pb2, draft_pb2_grpc
from redraft.proto.errors import InvalidQuery, RedraftError, TokenizerMismatch
from redraft.proto.tree import LEARNED, PLD, REST, Tree, source_label

_SOURCE_ENUM = {REST: draft_pb2.SOURCE_REST, PLD: draft_pb2.SOURCE_PLD,
                LEARNED: draft_pb2.SOURCE_LEARNED}


class ServiceError(RedraftError):
    """The draft service refused or failed a call; `code` is the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class ServiceUnavailable(ServiceError):
    """The server cannot be reached, went away, or is shutting down."""


class DraftTimeout(ServiceError):
    """A call or a session step ran past its deadline."""


class InvalidRequest(ServiceError, InvalidQuery):
    """The server rejected the request's content (token ids, budget, corpora, ...)."""


class IncompatibleTokenizer(ServiceError, TokenizerMismatch):
    """The datastore was built with another tokenizer than the caller's."""


class LimitExceeded(ServiceError):
    """A server limit was hit: sessions, context length, message size, idle timeout."""


class AuthenticationFailed(ServiceError):
    """Missing or wrong token."""


class UnknownSequence(ServiceError):
    """A batched entry named a sequence the server does not hold (never opened, closed,
    swept after idling, or the server restarted): open it again with its whole context."""


_ERRORS: dict[grpc.StatusCode, type[ServiceError]] = {
    grpc.StatusCode.NOT_FOUND: UnknownSequence,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailable,
    grpc.StatusCode.CANCELLED: ServiceUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DraftTimeout,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: IncompatibleTokenizer,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceeded,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationFailed,
}


def _typed(exc: grpc.RpcError, address: str) -> ServiceError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return _error(code, details, address)


def _error(code: grpc.StatusCode | None, details: str, address: str) -> ServiceError:
    cls = _ERRORS.get(code, ServiceError)
    name = code.name if code is not None else "ERROR"
    return cls(f"draft service {address}: {name}: {details}", code)


_STATUS = {c.value[0]: c for c in grpc.StatusCode}  # wire value -> StatusCode


@dataclass
class DraftParams:
    """Drafting parameters; 0 / empty means the server's default."""

    budget: int = 0
    max_depth: int = 0
    sources: Sequence[str] = (REST, PLD)
    corpora: Sequence[str] = ()
    min_match_len: int = 0
    max_match_len: int = 0

    def to_proto(self) -> draft_pb2.DraftParams:
        for name in ("budget", "max_depth", "min_match_len", "max_match_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0 or value >= 1 << 32:
                raise InvalidRequest(f"{name} must be a non-negative integer, got {value!r}")
        unknown = [s for s in self.sources if s not in _SOURCE_ENUM]
        if unknown:
            raise InvalidRequest(f"unknown draft sources {unknown} (use 'rest', 'pld', "
                                 "'learned')")
        return draft_pb2.DraftParams(
            budget=self.budget,
            max_depth=self.max_depth,
            sources=[_SOURCE_ENUM[s] for s in self.sources],
            corpora=list(self.corpora),
            min_match_len=self.min_match_len,
            max_match_len=self.max_match_len,
        )


@dataclass
class ServiceInfo:
    """What the server's datastore is: compare `tokenizer_fingerprint` before decoding."""

    tokenizer_fingerprint: str
    tokenizer_name: str
    vocab_size: int
    n_tokens: int
    n_docs: int
    n_shards: int
    format_version: int
    learn: str = "off"  # the server's learning: "tenant", "global" or "off"
    corpora: dict[str, dict[str, int]] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)


def tree_from_proto(reply: draft_pb2.DraftReply) -> Tree:
    """Proto DraftReply -> Tree (sources as 'rest', 'pld', 'pld+rest'), 1:1.

    A reply whose tree is not a valid tree (arrays of different lengths, a missing
    probability, a parent after its child) is a server error, never filled in.
    """
    t = reply.tree
    draft = Tree(
        tokens=list(t.tokens),
        parents=list(t.parents),
        probs=list(t.probs),
        sources=[source_label(s) for s in t.sources],
        match_len=int(reply.match_len),
    )
    try:
        draft.validate()
    except ValueError as exc:
        raise ServiceError(f"the draft service sent a malformed tree: {exc}") from None
    return draft


TOKEN_ENV = "REDRAFT_TOKEN"  # as `redraft.datastore.cli.client_options` names it


def check_token(token: str, where: str = "token") -> None:
    """A token must be printable ASCII: gRPC sends metadata values as such, so no client
    could present any other (a server would accept it and refuse every call)."""
    if not (token.isascii() and token.isprintable()):
        raise ServiceError(f"{where}: a token must be printable ASCII (gRPC metadata "
                           "cannot carry anything else)")


def read_tokens(path: str | None) -> tuple[str, ...]:
    """The shared secrets in the file at `path` (one per line), else the one in
    $REDRAFT_TOKEN, else none; each checked (`check_token`)."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                tokens = tuple(line.strip() for line in f if line.strip())
        except (OSError, UnicodeDecodeError) as exc:
            raise ServiceError(f"cannot read --token-file: {exc}") from exc
        if not tokens:
            raise ServiceError(f"--token-file {path} is empty")
        where = f"--token-file {path}"
    else:
        token = os.environ.get(TOKEN_ENV)
        tokens, where = ((token,) if token else ()), f"${TOKEN_ENV}"
    for t in tokens:
        check_token(t, where)
    return tokens


def client_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The one token a client sends: `--token`, else the one in `--token-file`, else
    $REDRAFT_TOKEN, else none. A file keeps the secret out of `ps`."""
    if token is not None and token_file is not None:
        raise ServiceError("give --token or --token-file, not both")
    if token is not None:
        check_token(token, "--token")
        return token
    tokens = read_tokens(token_file)
    if len(tokens) > 1:
        raise ServiceError(f"--token-file {token_file} holds {len(tokens)} tokens; a client "
                           "sends one")
    return tokens[0] if tokens else None


def client_tls(tls: bool, tls_ca: str | None) -> bool | str:
    """`DraftClient`'s `tls` from the command line: a CA file, the system's roots, or off."""
    if tls_ca is not None:
        if not os.path.isfile(tls_ca):
            raise ServiceError(f"TLS file not found: {tls_ca}")
        return tls_ca
    return bool(tls)


def _check_ids(tokens: Sequence[int], what: str) -> list[int]:
    out = [int(t) for t in tokens]
    if out and (min(out) < 0 or max(out) >= 1 << 31):
        raise InvalidRequest(f"{what}: token ids must be in [0, 2^31)")
    return out


# ---- the batched RPC's entries and results ------------------------------------------------


@dataclass
class SequenceOpen:
    """Start sequence `sequence` with its whole context `prompt` (or start it again)."""

    sequence: str
    prompt: Sequence[int]
    params: DraftParams | None = None  # None: the batch's params
    tenant: str = ""  # "": the batch's tenant


@dataclass
class SequenceStep:
    """The tokens sequence `sequence` accepted since its last entry (budget 0: its own)."""

    sequence: str
    accepted: Sequence[int]
    budget: int = 0


@dataclass
class SequenceEnd:
    """Sequence `sequence` is over; `accepted`: its last tokens, learned first."""

    sequence: str
    accepted: Sequence[int] = ()


SequenceEntry = SequenceOpen | SequenceStep | SequenceEnd


@dataclass
class PackedSteps:
    """Steps of many sequences, sent as a few arrays (the wire's PackedSteps): sequence
    `sequences[i]` accepted `accepted[i]` (a list or array of ids) and drafts with
    `budgets[i]` nodes (0: its own; None: every step its own). What an engine sends every
    step, without a message per sequence."""

    sequences: list[str]
    accepted: Sequence[Sequence[int]]
    budgets: Sequence[int] | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    def to_proto(self, out: draft_pb2.PackedSteps) -> None:
        """Fills `out` (the request's `steps`), refusing what the entry form refuses."""
        n = len(self.sequences)
        if len(self.accepted) != n or (self.budgets is not None and len(self.budgets) != n):
            raise InvalidRequest(f"packed steps: {n} sequences, {len(self.accepted)} accepted "
                                 f"lists, {'no' if self.budgets is None else len(self.budgets)}"
                                 " budgets")
        counts = np.fromiter(map(len, self.accepted), np.int64, n)
        if all(isinstance(a, np.ndarray) for a in self.accepted):  # an engine's rows
            try:
                tokens = np.concatenate([*self.accepted, np.zeros(0, np.int64)],
                                        dtype=np.int64, casting="same_kind")
            except TypeError:
                raise InvalidRequest("accepted: token ids must be integers") from None
        else:
            tokens = np.array(list(itertools.chain.from_iterable(self.accepted)), np.int64)
        if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= 1 << 31):
            raise InvalidRequest("accepted: token ids must be in [0, 2^31)")
        out.sequences.extend(self.sequences)
        out.accepted = tokens.astype("<u4").tobytes()
        out.counts = counts.astype("<u4").tobytes()
        if self.budgets is not None:
            budgets = np.array(self.budgets)
            if len(budgets) and (budgets.dtype.kind not in "iu" or int(budgets.min()) < 0
                                 or int(budgets.max()) >= 1 << 32):
                raise InvalidRequest("budget must be a non-negative integer, got "
                                     f"{next(b for b in self.budgets if not _is_budget(b))!r}")
            if budgets.any():
                out.budgets = budgets.astype("<u4").tobytes()


def _is_budget(b) -> bool:
    return isinstance(b, (int, np.integer)) and 0 <= b < 1 << 32


@dataclass
class BatchResults:
    """The reply of one batched call: per entry, in order, its error (None: it worked) and
    its tree (its best chain when the call asked for chains), plus every tree's nodes as
    arrays (entry i's are [offsets[i], offsets[i + 1]) of tokens, parents, probs, sources:
    uint32, int32, float32 and uint8 source bits), for callers that never need a Tree."""

    sequences: list[str]
    errors: list[ServiceError | None]
    context_lens: list[int]
    match_lens: list[int]
    expected_accepted: list[float]
    offsets: np.ndarray
    tokens: np.ndarray
    parents: np.ndarray
    probs: np.ndarray
    sources: np.ndarray
    server_us: float

    def __len__(self) -> int:
        return len(self.sequences)

    def tree(self, i: int) -> Tree:
        """Entry i's tree (empty when it failed or drafted nothing)."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Tree(self.tokens[a:b].tolist(), self.parents[a:b].tolist(),
                    self.probs[a:b].tolist(), [_LABELS[x & 7] for x in self.sources[a:b].tolist()],
                    self.match_lens[i])

    def chain(self, i: int) -> list[int]:
        """Entry i's tokens, in order (its chain when the call asked for chains)."""
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])].tolist()


_LABELS = [source_label(bits) for bits in range(8)]


def _add_entry(add, entry: SequenceEntry) -> None:
    """Appends `entry` to a request's entries (`add`: their `add`). Fields are set on the
    added message in place: building each entry as its own message and copying it in costs
    about twice as much, per entry of every engine step."""
    if isinstance(entry, SequenceStep):
        if not isinstance(entry.budget, int) or not 0 <= entry.budget < 1 << 32:
            raise InvalidRequest(f"budget must be a non-negative integer, got {entry.budget!r}")
        step = add(sequence=entry.sequence).step
        step.accepted[:] = _check_ids(entry.accepted, "accepted")
        if entry.budget:
            step.budget = entry.budget
        else:
            step.SetInParent()  # an empty step is still a step
        return
    if isinstance(entry, SequenceOpen):
        opening = add(sequence=entry.sequence).open
        opening.prompt[:] = _check_ids(entry.prompt, "prompt")
        opening.tenant = entry.tenant
        if entry.params is not None:
            opening.params.CopyFrom(entry.params.to_proto())
        opening.SetInParent()
        return
    if isinstance(entry, SequenceEnd):
        close = add(sequence=entry.sequence).close
        close.accepted[:] = _check_ids(entry.accepted, "accepted")
        close.SetInParent()
        return
    raise InvalidRequest(f"a batch entry is a SequenceOpen, SequenceStep or SequenceEnd, not "
                         f"a {type(entry).__name__}")


def _batch_results(reply: draft_pb2.BatchReply, address: str,
                   steps: PackedSteps | None = None) -> BatchResults:
    """The reply's packed arrays as numpy views (the entries' results, then the packed
    steps'); a reply whose arrays do not fit its results is a server error, never filled
    in."""
    rs = reply.results
    # One pass over the results (each element reached from Python is an object made anew).
    sequences, errors, context_lens, match_lens, expected = [], [], [], [], []
    counts = np.zeros(len(rs), np.int64)
    for i, r in enumerate(rs):
        sequences.append(r.sequence)
        code = r.code
        errors.append(None if code == 0 else _error(_STATUS.get(code), r.message, address))
        counts[i] = r.nodes
        context_lens.append(r.context_len)
        match_lens.append(r.match_len)
        expected.append(r.expected_accepted)
    if steps is not None:
        counts = np.concatenate([counts, _step_results(
            reply.steps, steps, address, sequences, errors, context_lens, match_lens,
            expected)])
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    t = reply.trees
    n = int(offsets[-1])
    arrays = (np.frombuffer(t.tokens, "<u4"), np.frombuffer(t.parents, "<i4"),
              np.frombuffer(t.probs, "<f4"), np.frombuffer(t.sources, np.uint8))
    if any(len(a) != n for a in arrays):
        raise ServiceError(f"draft service {address}: the batch reply's trees hold "
                           f"{[len(a) for a in arrays]} nodes, its results {n}")
    return BatchResults(sequences, errors, context_lens, match_lens, expected,
                        offsets, *arrays, float(reply.server_us))


def _step_results(r: draft_pb2.PackedResults, steps: PackedSteps, address: str,
                  sequences: list, errors: list, context_lens: list, match_lens: list,
                  expected: list) -> np.ndarray:
    """The packed steps' results appended to the lists; returns their node counts."""
    n = len(steps)
    nodes = np.frombuffer(r.nodes, "<u4")
    lens = np.frombuffer(r.context_lens, "<u8")
    mls = np.frombuffer(r.match_lens, "<u4")
    exp = np.frombuffer(r.expected_accepted, "<f4")
    failed = list(r.failed)
    if (len(nodes), len(lens), len(mls), len(exp)) != (n, n, 3 * n, n) or len(failed) != len(
            r.failed_codes) or len(failed) != len(r.failed_messages) or (
            failed and not 0 <= min(failed) <= max(failed) < n):
        raise ServiceError(f"draft service {address}: the batch reply's step results do not "
                           f"fit its {n} steps (a server without packed steps? call with "
                           "packed=False)")
    first = len(errors)
    sequences += steps.sequences
    errors += [None] * n
    for i, code, message in zip(failed, r.failed_codes, r.failed_messages):
        errors[first + i] = _error(_STATUS.get(code), message, address)
    context_lens += lens.tolist()
    match_lens += mls[::3].tolist()
    expected += exp.tolist()
    return nodes.astype(np.int64)


def channel_target(address: str) -> str:
    """The gRPC target for `address`: one `host:port`, or a target with a scheme
    (`dns:///name:port`: every address the name resolves to), as given; several
    comma-separated `host:port` as one `ipv4:`/`ipv6:` list, each host resolved here (gRPC
    has no list of names)."""
    parts = [p.strip() for p in address.split(",")]
    if len(parts) == 1:
        return parts[0]
    if not all(parts):
        raise ServiceError(f"draft service address {address!r} has an empty entry")
    resolved: list[tuple[int, str]] = []
    for part in parts:
        host, sep, port = part.rpartition(":")
        if not sep or not port.isdigit() or "://" in part:
            raise ServiceError(f"draft service address {part!r}: expected host:port in a "
                               "comma-separated list")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise ServiceUnavailable(f"draft service {part}: cannot resolve {host!r} "
                                     f"({exc})") from None
        families = {info[0] for info in infos}
        family = socket.AF_INET if socket.AF_INET in families else socket.AF_INET6
        ip = next(info[4][0] for info in infos if info[0] == family)
        resolved.append((family, f"{ip}:{port}" if family == socket.AF_INET
                         else f"[{ip}]:{port}"))
    if len({f for f, _ in resolved}) > 1:
        raise ServiceError(f"draft service {address!r}: mixes IPv4 and IPv6 addresses; "
                           "use one family (or a DNS name)")
    scheme = "ipv4" if resolved[0][0] == socket.AF_INET else "ipv6"
    return f"{scheme}:" + ",".join(a for _, a in resolved)


class DraftClient:
    """A connection to a draft server, or to several replicas of it.

    Thread-safe: any number of threads may share one client, each with sessions of its own
    and unary calls (gRPC channels are). A `DraftSession` is not: it is one ordered stream,
    stepped by one thread at a time (steps from two threads would interleave their tokens).

    With several addresses (comma-separated, or a DNS name with several records) gRPC's own
    round_robin policy spreads calls and sessions over the replicas that are up; a session
    is one stream, so it stays on its replica; when a replica goes away, new sessions go to
    the others and a running one reopens on another (its one transparent reconnect).
    """

    def __init__(
        self,
        address: str,
        token: str | None = None,
        tls: bool | str = False,
        timeout: float = 5.0,
        max_message_bytes: int = 16 << 20,
        reconnect: bool = True,
        own_connection: bool = False,
    ) -> None:
        """`address`: `host:port`, several of them comma-separated, or `dns:///name:port`.
        `tls`: False (plaintext), True (system roots) or a CA/cert PEM file path (with
        several addresses the certificate must be valid for the first one's host).

        gRPC shares one connection among a process's channels to the same address;
        `own_connection=True` gives this client its own (so a multi-worker server can spread
        clients over its processes).
        """
        self.address = address
        self.timeout = float(timeout)
        self.reconnect = reconnect
        if token:
            check_token(token)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Reconnect fast after a server restart instead of backing off for seconds.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        target = channel_target(address)
        if target != address:  # a list: the authority (and TLS host) is the first entry's
            options.append(("grpc.default_authority", address.split(",")[0].strip()))
        if target != address or ":///" in address:
            # Replicas: spread over every address the target names. (One server keeps
            # pick_first, which reconnects on demand: a restarted server is reached by the
            # very next call instead of after a reconnect backoff.)
            options.append(("grpc.lb_policy_name", "round_robin"))
        if own_connection:
            options.append(("grpc.use_local_subchannel_pool", 1))
        if tls:
            roots = None
            if isinstance(tls, str):
                try:
                    with open(tls, "rb") as f:
                        roots = f.read()
                except OSError as exc:
                    raise ServiceError(f"cannot read TLS certificates {tls}: "
                                       f"{exc.strerror or exc}") from None
            creds = grpc.ssl_channel_credentials(root_certificates=roots)
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = draft_pb2_grpc.DrafterStub(self._channel)
        self._sessions: weakref.WeakSet[DraftSession] = weakref.WeakSet()
        self._watchdog: threading.Thread | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()

    # ---- unary calls -------------------------------------------------------------------
    def _unary(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata,
                          wait_for_ready=False)
        except grpc.RpcError as exc:
            raise _typed(exc, self.address) from None

    def info(self, timeout: float | None = None) -> ServiceInfo:
        r = self._unary(self._stub.Info, draft_pb2.InfoRequest(), timeout)
        lim = r.limits
        return ServiceInfo(
            tokenizer_fingerprint=r.tokenizer_fingerprint,
            tokenizer_name=r.tokenizer_name,
            vocab_size=r.vocab_size,
            n_tokens=r.n_tokens,
            n_docs=r.n_docs,
            n_shards=r.n_shards,
            format_version=r.format_version,
            learn=r.learn or "off",
            corpora={c.name: {"n_docs": c.n_docs, "n_tokens": c.n_tokens} for c in r.corpora},
            limits={
                "max_context_len": lim.max_context_len,
                "max_budget": lim.max_budget,
                "max_sessions": lim.max_sessions,
                "idle_timeout_s": lim.idle_timeout_s,
                "max_message_bytes": lim.max_message_bytes,
            },
            manifest=json.loads(r.manifest_json) if r.manifest_json else {},
        )

    def propose(self, context: Sequence[int], params: DraftParams | None = None,
                tokenizer_fingerprint: str = "", timeout: float | None = None,
                tenant: str = "") -> Tree:
        """One-off draft for a full context (no server-side state; nothing is learned)."""
        req = draft_pb2.ProposeRequest(
            context=_check_ids(context, "context"),
            params=(params or DraftParams()).to_proto(),
            tokenizer_fingerprint=tokenizer_fingerprint,
            tenant=tenant,
        )
        return tree_from_proto(self._unary(self._stub.Propose, req, timeout))

    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        """The server's counters (requests, sessions, errors, hit rate, latency, ...)."""
        r = self._unary(self._stub.Stats, draft_pb2.StatsRequest(), timeout)
        return json.loads(r.stats_json)

    def batch(self, entries: Sequence[SequenceEntry], params: DraftParams | None = None,
              tokenizer_fingerprint: str = "", tenant: str = "", chain: int = 0,
              client_id: str = "", timeout: float | None = None,
              steps: PackedSteps | None = None, packed: bool = True) -> BatchResults:
        """Many sequences' entries in one call (an engine's step): opens, steps and ends of
        sequences the server keeps between calls under (this client's token, `client_id`,
        sequence id). Per entry: an error (the status a session would end with, e.g.
        UnknownSequence, InvalidRequest, LimitExceeded) or a tree; a failed entry never
        fails the others. `params`, `tenant`: for opens without their own. `chain` > 0:
        each tree is its best chain of at most that many nodes. A failure of the call
        itself (unreachable, auth, tokenizer) raises. batch_client.SequenceBatch keeps
        track of the sequences for you.

        `steps`: more steps, after the entries, sent packed (results after the entries').
        Without `steps`, the step entries after the last open or end are sent packed
        (`packed=False`: every entry as its own message, as servers before packed steps
        need); the results are in the entries' order either way."""
        if not isinstance(chain, int) or not 0 <= chain < 1 << 32:
            raise InvalidRequest(f"chain must be a non-negative integer, got {chain!r}")
        req = draft_pb2.BatchRequest(client=client_id, tokenizer_fingerprint=tokenizer_fingerprint,
                                     tenant=tenant, chain=chain)
        if steps is None and packed:  # the steps after the last open or end go packed
            k = len(entries)
            while k and entries[k - 1].__class__ is SequenceStep:
                k -= 1
            if k < len(entries):
                tail = entries[k:]
                steps = PackedSteps([e.sequence for e in tail], [e.accepted for e in tail],
                                    [e.budget for e in tail])
                entries = entries[:k]
        add = req.entries.add
        for e in entries:
            _add_entry(add, e)
        if steps is not None:
            steps.to_proto(req.steps)
        if params is not None:
            req.params.CopyFrom(params.to_proto())
        return _batch_results(self._unary(self._stub.Batch, req, timeout), self.address, steps)

    def session(self, prompt: Sequence[int], params: DraftParams | None = None,
                tokenizer_fingerprint: str = "", timeout: float | None = None,
                tenant: str = "") -> DraftSession:
        """A drafting session; use as a context manager (it opens on enter).

        The server learns the tokens each step reports as accepted, for `tenant` (with
        auth, the token's tenant, subdivided by this one), and drafts them for the same
        tenant when `params.sources` include "learned".
        """
        return DraftSession(self, prompt, params or DraftParams(), tokenizer_fingerprint,
                            timeout or self.timeout, tenant)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            sessions = list(self._sessions)
        for s in sessions:
            s.close()
        self._channel.close()

    def __enter__(self) -> DraftClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- step deadlines ----------------------------------------------------------------
    def _watch(self, session: DraftSession) -> None:
        with self._lock:
            self._sessions.add(session)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch_loop, daemon=True,
                                                  name="redraft-client-watchdog")
                self._watchdog.start()

    def _watch_loop(self) -> None:
        """Cancel session steps that overran their deadline (streams have no per-message one)."""
        tick = 0.1
        while not self._closed.wait(tick):
            now = time.monotonic()
            busy = False
            with self._lock:  # sessions are added from other threads
                sessions = list(self._sessions)
            for s in sessions:
                busy = s._check_deadline(now) or busy
            tick = 0.02 if busy else 0.1  # a step's deadline is checked at least every 0.1 s


_END = object()


class DraftSession:
    """One streaming session: the server keeps the context, each step sends only new tokens.

    Not thread-safe: its steps are one ordered conversation; use one session per thread
    (sessions of one client may run in parallel threads).
    """

    def __init__(self, client: DraftClient, prompt: Sequence[int], params: DraftParams,
                 tokenizer_fingerprint: str, timeout: float, tenant: str = "") -> None:
        self.client = client
        self.params = params
        self.fingerprint = tokenizer_fingerprint
        self.tenant = tenant
        self.timeout = timeout
        self.context: list[int] = _check_ids(prompt, "prompt")
        self._proto_params = params.to_proto()
        self.draft: Tree = Tree()
        self.session_id = ""
        self.context_len = 0
        self.pld_match_len = 0
        self.learned_match_len = 0
        self.expected_accepted = 0.0
        self.reconnects = 0
        self._call = None
        self._requests: queue.SimpleQueue | None = None
        self._deadline: float | None = None
        self._timed_out = False

    # ---- lifecycle ---------------------------------------------------------------------
    def __enter__(self) -> DraftSession:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> Tree:
        """Open the stream with the whole context; returns (and keeps) the first draft."""
        self.close()
        requests: queue.SimpleQueue = queue.SimpleQueue()
        self._requests = requests

        def feed() -> Iterator[draft_pb2.SessionRequest]:
            while True:
                item = requests.get()
                if item is _END:
                    return
                yield item

        self._call = self.client._stub.Session(feed(), metadata=self.client._metadata)
        self.client._watch(self)
        opening = draft_pb2.SessionRequest(
            open=draft_pb2.SessionOpen(prompt=self.context, params=self._proto_params,
                                       tokenizer_fingerprint=self.fingerprint,
                                       tenant=self.tenant)
        )
        return self._exchange(opening)

    def close(self) -> None:
        """End the stream (the server frees the session at once)."""
        if self._requests is not None:
            self._requests.put(_END)
            self._requests = None
        if self._call is not None:
            self._call.cancel()
            self._call = None
        self._deadline = None

    # ---- steps -------------------------------------------------------------------------
    def step(self, accepted: Sequence[int], budget: int | None = None) -> Tree:
        """Append the tokens accepted since the last step; returns the next draft.

        The tokens count as part of the context even when the step fails (the decoder
        accepted them whatever the drafts did), so a later step or reconnect stays in sync.
        After the server went away or a step timed out, the next step reopens the session
        with the whole context (when the client was made with reconnect=True).
        """
        accepted = _check_ids(accepted, "accepted")
        if budget is not None and (budget < 0 or budget >= 1 << 32):
            raise InvalidRequest(f"budget must be a non-negative integer, got {budget}")
        if self._call is None and not (self.session_id and self.client.reconnect):
            raise ServiceError("session is not open (use it as a context manager)")
        self.context.extend(accepted)
        if self._call is None:
            return self._reopen(budget)
        req = draft_pb2.SessionRequest(
            step=draft_pb2.SessionStep(accepted=accepted, budget=budget or 0)
        )
        try:
            return self._exchange(req)
        except ServiceUnavailable:
            if not self.client.reconnect:
                raise
            return self._reopen(budget)  # server restarted or failed over: try once more

    def _reopen(self, budget: int | None) -> Tree:
        """Open a fresh stream with the whole context (this step's budget, if any)."""
        self.reconnects += 1
        saved = self._proto_params
        if budget:
            self._proto_params = draft_pb2.DraftParams()
            self._proto_params.CopyFrom(saved)
            self._proto_params.budget = budget
        try:
            return self.open()
        finally:
            self._proto_params = saved

    def _exchange(self, req: draft_pb2.SessionRequest) -> Tree:
        call, requests = self._call, self._requests
        if call is None or requests is None:
            raise ServiceError("session is closed")
        self._timed_out = False
        self._deadline = time.monotonic() + self.timeout
        try:
            requests.put(req)
            reply = next(call)
        except StopIteration:
            self.close()
            raise ServiceUnavailable(
                f"draft service {self.client.address}: session ended by the server"
            ) from None
        except grpc.RpcError as exc:
            self.close()
            if self._timed_out:
                raise DraftTimeout(
                    f"draft service {self.client.address}: step took over {self.timeout:g} s",
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ) from None
            raise _typed(exc, self.client.address) from None
        finally:
            self._deadline = None
        self.session_id = reply.session_id
        self.context_len = int(reply.context_len)
        self.pld_match_len = int(reply.draft.pld_match_len)
        self.learned_match_len = int(reply.draft.learned_match_len)
        self.expected_accepted = float(reply.draft.expected_accepted)
        self.draft = tree_from_proto(reply.draft)
        return self.draft

    def _check_deadline(self, now: float) -> bool:
        """Cancel an overrunning step; True while a step is in flight."""
        deadline, call = self._deadline, self._call
        if deadline is None or call is None:
            return False
        if now > deadline:
            self._timed_out = True
            call.cancel()
        return True
