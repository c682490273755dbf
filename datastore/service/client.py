"""The Python client of the draft service, as the decoder uses it.

Why a class of our own over the raw stubs: a decoder must never hang or crash because a
draft server is slow or gone. Every call has a deadline, a session step too (a watchdog
cancels a step that overruns), failures surface as a few typed errors (so the decoder can
fall back to local drafting), and a session whose server restarted is reopened with the
context the client kept, once, transparently. The messages are built and read by `wire`;
this module is the connection: channels, deadlines, the sessions' streams.

    client = DraftClient("127.0.0.1:50051", token=None, timeout=2.0)
    # or replicas: DraftClient("10.0.0.1:50051,10.0.0.2:50051"), DraftClient("dns:///drafts:50051")
    info = client.info()
    with client.session(prompt_ids, DraftParams(budget=32), info.tokenizer_fingerprint) as s:
        draft = s.draft                 # for the prompt
        draft = s.step(accepted_ids)    # after each verification
"""

from __future__ import annotations

import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from redraft.datastore.service import wire
from redraft.datastore.service.client_errors import (
    AuthenticationFailed,
    DraftTimeout,
    IncompatibleTokenizer,
    InvalidRequest,
    LimitExceeded,
    ServiceError,
    ServiceUnavailable,
    UnknownSequence,
    typed,
)
from redraft.datastore.service.credentials import (
    TOKEN_ENV,
    check_token,
    client_tls,
    client_token,
    read_tokens,
)
from redraft.datastore.service.wire import (
    BatchResults,
    DraftParams,
    PackedSteps,
    SequenceEnd,
    SequenceEntry,
    SequenceOpen,
    SequenceStep,
    ServiceInfo,
)
from redraft.proto import draft_pb2, draft_pb2_grpc
from redraft.proto.tree import Tree

# What callers import from here (the decoder reaches the service through this module and
# batch_client): the values and errors live in `wire` and `client_errors`.
__all__ = [
    "TOKEN_ENV", "AuthenticationFailed", "BatchResults", "DraftClient", "DraftParams",
    "DraftSession", "DraftTimeout", "IncompatibleTokenizer", "InvalidRequest",
    "LimitExceeded", "PackedSteps", "SequenceEnd", "SequenceEntry", "SequenceOpen",
    "SequenceStep", "ServiceError", "ServiceInfo", "ServiceUnavailable", "UnknownSequence",
    "channel_target", "check_token", "client_tls", "client_token", "read_tokens",
]


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
            raise typed(exc, self.address) from None

    def info(self, timeout: float | None = None) -> ServiceInfo:
        return wire.info_value(self._unary(self._stub.Info, draft_pb2.InfoRequest(), timeout))

    def propose(self, context: Sequence[int], params: DraftParams | None = None,
                tokenizer_fingerprint: str = "", timeout: float | None = None,
                tenant: str = "") -> Tree:
        """One-off draft for a full context (no server-side state; nothing is learned)."""
        req = wire.propose_request(context, params, tokenizer_fingerprint, tenant)
        return wire.tree_value(self._unary(self._stub.Propose, req, timeout))

    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        """The server's counters (requests, sessions, errors, hit rate, latency, ...)."""
        return wire.stats_value(self._unary(self._stub.Stats, draft_pb2.StatsRequest(), timeout))

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
        req, steps = wire.batch_request(entries, params, tokenizer_fingerprint, tenant, chain,
                                        client_id, steps, packed)
        return wire.batch_results(self._unary(self._stub.Batch, req, timeout), self.address,
                                  steps)

    def batch_async(self, entries: Sequence[SequenceEntry], params: DraftParams | None = None,
                    tokenizer_fingerprint: str = "", tenant: str = "", chain: int = 0,
                    client_id: str = "", timeout: float | None = None,
                    steps: PackedSteps | None = None) -> Callable[[], BatchResults]:
        """`batch`, sent without waiting for the reply: the function returned waits for it
        and gives its results (raising as `batch` would). Why: an engine step that wants no
        drafts still has tokens for the server to learn, and need not wait a round trip."""
        req, steps = wire.batch_request(entries, params, tokenizer_fingerprint, tenant, chain,
                                        client_id, steps, True)
        future = self._stub.Batch.future(req, timeout=timeout or self.timeout,
                                         metadata=self._metadata, wait_for_ready=False)

        def results() -> BatchResults:
            try:
                reply = future.result()
            except grpc.RpcError as exc:
                raise typed(exc, self.address) from None
            return wire.batch_results(reply, self.address, steps)

        return results

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
        self.context: list[int] = wire.check_ids(prompt, "prompt")
        self._proto_params = wire.params_message(params)
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
        return self._exchange(wire.open_request(self.context, self._proto_params,
                                                self.fingerprint, self.tenant))

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
        accepted = wire.check_ids(accepted, "accepted")
        if budget is not None and (budget < 0 or budget >= 1 << 32):
            raise InvalidRequest(f"budget must be a non-negative integer, got {budget}")
        if self._call is None and not (self.session_id and self.client.reconnect):
            raise ServiceError("session is not open (use it as a context manager)")
        self.context.extend(accepted)
        if self._call is None:
            return self._reopen(budget)
        try:
            return self._exchange(wire.step_request(accepted, budget))
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
            raise typed(exc, self.client.address) from None
        finally:
            self._deadline = None
        self.session_id = reply.session_id
        self.context_len = int(reply.context_len)
        drafted = wire.draft_value(reply.draft)
        self.pld_match_len = drafted.pld_match_len
        self.learned_match_len = drafted.learned_match_len
        self.expected_accepted = drafted.expected_accepted
        self.draft = drafted.tree
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
