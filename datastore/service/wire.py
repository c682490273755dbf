"""The wire conversion: redraft's values to the protobuf messages of redraft.v1 and back,
both directions, for the client (requests out, replies in), the batch tracker and the
server (requests in, replies out).

Why one module: each message has one encoding and one decoding, so the client and the
server cannot drift apart (a field the server fills but the client never reads, a packed
array one side reads with another element size), and a round trip can be tested without a
network. What a value may hold is checked here where the wire limits it (ids in [0, 2^31),
counts and budgets as uint32) and refused as the receiving side refuses it: a client's bad
value raises `InvalidRequest` before anything is sent; a server's bad packing raises the
`Refusal` (INVALID_ARGUMENT) its call ends with; a reply that does not add up raises
`ServiceError`, never filled in. What a request may ask of a datastore (vocabulary, limits)
is `validation`'s, not the wire's.

Packed arrays (the batched RPC's) are little-endian: tokens and counts uint32, parents
int32, probabilities float32, source bits uint8, context lengths uint64; decoding them is a
numpy view of the bytes.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from redraft.datastore.service.client_errors import (
    STATUS,
    InvalidRequest,
    ServiceError,
    error_for,
)
from redraft.datastore.service.refusals import Refusal, bad
from redraft.proto import draft_pb2
from redraft.proto.flat_trees import FlatTrees

# DraftParams: the request's parameters, one value for every side (its home is proto/params;
# the client's users import it from here and from the client).
from redraft.proto.params import SOURCE_NAMES, DraftParams, InvalidParams
from redraft.proto.tree import SOURCE_LABELS, Chain, Tree, source_bits

_UINT32 = 1 << 32


# ---- values ------------------------------------------------------------------------------


@dataclass
class Drafted:
    """One draft as a reply carries it: the tree (its `match_len` the retrieval's), the
    match lengths of the other sources, the expected accepted tokens."""

    tree: Tree
    match_len: int = 0
    pld_match_len: int = 0
    learned_match_len: int = 0
    expected_accepted: float = 0.0


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


LIMITS = ("max_context_len", "max_budget", "max_sessions", "idle_timeout_s",
          "max_message_bytes")
# The Stats reply's fields; stats_json carries them and more.
STATS_FIELDS = ("requests", "sessions_opened", "sessions_active", "errors", "hits",
                "latency_p50_us", "latency_p99_us", "uptime_s")


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
        pack_steps(self, out)


@dataclass
class BatchResults:
    """The reply of one batched call: per entry, in order, its error (None: it worked) and
    its context length, and every entry's tree (its best chain when the call asked for
    chains) in `trees`, one flat-trees value (entry i is its row i: `tree(i)`, `chain(i)`;
    its nodes as arrays, uint32 tokens, int32 parents, float32 probs and uint8 source bits,
    and its match lengths (retrieval, prompt lookup, learned) and expected accepted tokens,
    for callers that never need a Tree)."""

    sequences: list[str]
    errors: list[ServiceError | None]
    context_lens: list[int]
    trees: FlatTrees
    server_us: float

    def __len__(self) -> int:
        return len(self.sequences)

    def tree(self, i: int) -> Tree:
        """Entry i's tree (empty when it failed or drafted nothing)."""
        return self.trees.tree(i)

    def chain(self, i: int) -> Chain:
        """Entry i's nodes in order (its chain when the call asked for chains)."""
        return self.trees.chain(i)

    # The nodes' arrays, read where a caller walks them without a Tree.
    offsets = property(lambda self: self.trees.offsets)
    tokens = property(lambda self: self.trees.tokens)
    parents = property(lambda self: self.trees.parents)
    probs = property(lambda self: self.trees.probs)


# ---- requests: values -> messages (the client) ------------------------------------------


def check_ids(tokens: Sequence[int], what: str) -> list[int]:
    """Token ids as the wire's int32 fields carry them."""
    out = [int(t) for t in tokens]
    if out and (min(out) < 0 or max(out) >= 1 << 31):
        raise InvalidRequest(f"{what}: token ids must be in [0, 2^31)")
    return out


def _check_uint32(name: str, value: Any) -> None:
    if not isinstance(value, int) or value < 0 or value >= _UINT32:
        raise InvalidRequest(f"{name} must be a non-negative integer, got {value!r}")


def params_message(p: DraftParams) -> draft_pb2.DraftParams:
    """`p` on the wire; a value it cannot carry raises InvalidRequest (`DraftParams.check`)."""
    try:
        return p.to_proto()
    except InvalidParams as exc:
        raise InvalidRequest(str(exc)) from None


def propose_request(context: Sequence[int], params: DraftParams | None,
                    tokenizer_fingerprint: str, tenant: str) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        context=check_ids(context, "context"),
        params=params_message(params or DraftParams()),
        tokenizer_fingerprint=tokenizer_fingerprint,
        tenant=tenant,
    )


def open_request(prompt: list[int], params: draft_pb2.DraftParams, tokenizer_fingerprint: str,
                 tenant: str) -> draft_pb2.SessionRequest:
    """A session's first request (`prompt` checked by `check_ids`)."""
    return draft_pb2.SessionRequest(open=draft_pb2.SessionOpen(
        prompt=prompt, params=params, tokenizer_fingerprint=tokenizer_fingerprint,
        tenant=tenant))


def step_request(accepted: list[int], budget: int | None) -> draft_pb2.SessionRequest:
    """A session's step (`accepted` checked by `check_ids`; budget None or 0: its own)."""
    if budget is not None and (budget < 0 or budget >= _UINT32):
        raise InvalidRequest(f"budget must be a non-negative integer, got {budget}")
    return draft_pb2.SessionRequest(step=draft_pb2.SessionStep(accepted=accepted,
                                                               budget=budget or 0))


def add_entry(add: Callable[..., draft_pb2.BatchEntry], entry: SequenceEntry) -> None:
    """Appends `entry` to a request's entries (`add`: their `add`). Fields are set on the
    added message in place: building each entry as its own message and copying it in costs
    about twice as much, per entry of every engine step."""
    if isinstance(entry, SequenceStep):
        if not isinstance(entry.budget, int) or not 0 <= entry.budget < _UINT32:
            raise InvalidRequest(f"budget must be a non-negative integer, got {entry.budget!r}")
        step = add(sequence=entry.sequence).step
        step.accepted[:] = check_ids(entry.accepted, "accepted")
        if entry.budget:
            step.budget = entry.budget
        else:
            step.SetInParent()  # an empty step is still a step
        return
    if isinstance(entry, SequenceOpen):
        opening = add(sequence=entry.sequence).open
        opening.prompt[:] = check_ids(entry.prompt, "prompt")
        opening.tenant = entry.tenant
        if entry.params is not None:
            opening.params.CopyFrom(params_message(entry.params))
        opening.SetInParent()
        return
    if isinstance(entry, SequenceEnd):
        close = add(sequence=entry.sequence).close
        close.accepted[:] = check_ids(entry.accepted, "accepted")
        close.SetInParent()
        return
    raise InvalidRequest(f"a batch entry is a SequenceOpen, SequenceStep or SequenceEnd, not "
                         f"a {type(entry).__name__}")


def _is_budget(b: Any) -> bool:
    return isinstance(b, (int, np.integer)) and 0 <= b < _UINT32


def pack_steps(steps: PackedSteps, out: draft_pb2.PackedSteps) -> None:
    """Fills `out` (a request's `steps`) from `steps`, refusing what the entry form
    refuses."""
    n = len(steps.sequences)
    if len(steps.accepted) != n or (steps.budgets is not None and len(steps.budgets) != n):
        raise InvalidRequest(f"packed steps: {n} sequences, {len(steps.accepted)} accepted "
                             f"lists, {'no' if steps.budgets is None else len(steps.budgets)}"
                             " budgets")
    counts = np.fromiter(map(len, steps.accepted), np.int64, n)
    if all(isinstance(a, np.ndarray) for a in steps.accepted):  # an engine's rows
        try:
            tokens = np.concatenate([*steps.accepted, np.zeros(0, np.int64)],
                                    dtype=np.int64, casting="same_kind")
        except TypeError:
            raise InvalidRequest("accepted: token ids must be integers") from None
    else:
        tokens = np.array(list(itertools.chain.from_iterable(steps.accepted)), np.int64)
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= 1 << 31):
        raise InvalidRequest("accepted: token ids must be in [0, 2^31)")
    out.sequences.extend(steps.sequences)
    out.accepted = tokens.astype("<u4").tobytes()
    out.counts = counts.astype("<u4").tobytes()
    if steps.budgets is not None:
        budgets = np.array(steps.budgets)
        if len(budgets) and (budgets.dtype.kind not in "iu" or int(budgets.min()) < 0
                             or int(budgets.max()) >= _UINT32):
            raise InvalidRequest("budget must be a non-negative integer, got "
                                 f"{next(b for b in steps.budgets if not _is_budget(b))!r}")
        if budgets.any():
            out.budgets = budgets.astype("<u4").tobytes()


def batch_request(entries: Sequence[SequenceEntry], params: DraftParams | None,
                  tokenizer_fingerprint: str, tenant: str, chain: int, client_id: str,
                  steps: PackedSteps | None, packed: bool
                  ) -> tuple[draft_pb2.BatchRequest, PackedSteps | None]:
    """A Batch request, and the packed steps it carries (the reply's step results are
    theirs). Without `steps` and with `packed`, the step entries after the last open or end
    go packed."""
    _check_uint32("chain", chain)
    req = draft_pb2.BatchRequest(client=client_id, tokenizer_fingerprint=tokenizer_fingerprint,
                                 tenant=tenant, chain=chain)
    if steps is None and packed:
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
        add_entry(add, e)
    if steps is not None:
        pack_steps(steps, req.steps)
    if params is not None:
        req.params.CopyFrom(params_message(params))
    return req, steps


# ---- requests: messages -> values (the server) ------------------------------------------


def source_names(sources: Sequence[int]) -> set[str]:
    """A request's sources by name; an unknown one is refused (INVALID_ARGUMENT)."""
    names = set()
    for s in sources:
        if s not in SOURCE_NAMES:
            raise bad(f"unknown source {s} (use SOURCE_REST={draft_pb2.SOURCE_REST}, "
                      f"SOURCE_PLD={draft_pb2.SOURCE_PLD} or "
                      f"SOURCE_LEARNED={draft_pb2.SOURCE_LEARNED})")
        names.add(SOURCE_NAMES[s])
    return names


def params_value(p: draft_pb2.DraftParams) -> DraftParams:
    """A request's parameters as the client gave them (sources in the message's order)."""
    source_names(p.sources)  # refuses an unknown one
    return DraftParams.from_proto(p)


def session_open(request: draft_pb2.SessionRequest) -> draft_pb2.SessionOpen:
    """A session's first request, which must be an open."""
    kind = request.WhichOneof("kind")
    if kind != "open":
        raise bad(f"a session must start with an `open` message (got `{kind or 'nothing'}`)")
    return request.open


def session_step(request: draft_pb2.SessionRequest, session_id: str) -> draft_pb2.SessionStep:
    """A later request of session `session_id`, which must be a step."""
    if request.WhichOneof("kind") != "step":
        raise bad(f"session {session_id} is already open: send `step` messages")
    return request.step


def entry_value(e: draft_pb2.BatchEntry) -> SequenceEntry:
    """A batch entry as the client's value (an entry with no kind is refused)."""
    kind = e.WhichOneof("kind")
    if kind == "step":
        return SequenceStep(e.sequence, list(e.step.accepted), e.step.budget)
    if kind == "open":
        o = e.open
        return SequenceOpen(e.sequence, list(o.prompt),
                            params_value(o.params) if o.HasField("params") else None, o.tenant)
    if kind == "close":
        return SequenceEnd(e.sequence, list(e.close.accepted))
    raise bad(f"entry for sequence {e.sequence!r} has no open, step or close")


@dataclass
class UnpackedSteps:
    """A request's packed steps as arrays (views of its bytes): step i names ids[i] and
    accepted tokens[starts[i]:starts[i] + counts[i]]; budgets None: every step its own."""

    ids: list[str]
    tokens: np.ndarray  # uint32
    counts: np.ndarray  # uint32
    budgets: np.ndarray | None  # uint32

    def value(self) -> PackedSteps:
        """As the client's value (for tools and tests: the server keeps the arrays)."""
        ends = np.cumsum(self.counts, dtype=np.int64)
        accepted = [self.tokens[e - c:e].tolist() for e, c in zip(ends.tolist(),
                                                                   self.counts.tolist())]
        return PackedSteps(list(self.ids), accepted,
                           None if self.budgets is None else self.budgets.tolist())


def unpack_steps(steps: draft_pb2.PackedSteps) -> UnpackedSteps:
    """The packing checked as a whole: a packing that does not add up fails the call with
    INVALID_ARGUMENT (`Refusal`)."""
    ids = list(steps.sequences)
    n = len(ids)
    for name in ("accepted", "counts", "budgets"):
        size = len(getattr(steps, name))
        if size % 4:
            raise bad(f"steps.{name} holds {size} bytes, not a whole number of uint32")
    counts = np.frombuffer(steps.counts, "<u4")
    if len(counts) != n:
        raise bad(f"steps.counts holds {len(counts)} counts for {n} sequences")
    tokens = np.frombuffer(steps.accepted, "<u4")
    total = int(counts.sum(dtype=np.uint64))
    if total != len(tokens):
        raise bad(f"steps.counts add up to {total} tokens, steps.accepted holds "
                  f"{len(tokens)}")
    budgets = np.frombuffer(steps.budgets, "<u4") if steps.budgets else None
    if budgets is not None and len(budgets) != n:
        raise bad(f"steps.budgets holds {len(budgets)} budgets for {n} sequences")
    return UnpackedSteps(ids, tokens, counts, budgets)


# ---- replies: values -> messages (the server) -------------------------------------------


_LABEL_BITS: dict[str, int] = {}  # every label met so far: a few ("pld+rest", ...)


def sources_bits(labels: Sequence[str]) -> list[int]:
    """The wire's source bits of each node's label, from a table of the labels met (a
    tree's 64 nodes through `source_bits` each take 70 us): for a Tree (`put_draft`); the
    server's own replies carry the core's bits as drafted (`put_nodes`)."""
    try:
        return list(map(_LABEL_BITS.__getitem__, labels))
    except KeyError:
        for label in set(labels) - _LABEL_BITS.keys():
            _LABEL_BITS[label] = source_bits(label)
        return list(map(_LABEL_BITS.__getitem__, labels))


def put_draft(out: draft_pb2.DraftReply, d: Drafted) -> None:
    """Fills `out` with draft `d` (sources as the wire's bits)."""
    tree = d.tree
    put_nodes(out, tree.tokens, tree.parents, tree.probs, sources_bits(tree.sources),
              d.match_len, d.pld_match_len, d.learned_match_len, d.expected_accepted)


def put_nodes(out: draft_pb2.DraftReply, tokens: Sequence[int], parents: Sequence[int],
              probs: Sequence[float], bits: Sequence[int], match_len: int,
              pld_match_len: int, learned_match_len: int, expected_accepted: float) -> None:
    """Fills `out` with a tree given as its nodes' arrays, sources as the wire's bits (what
    the compiled core drafts: the server's Session replies, no label in between)."""
    t = out.tree
    t.tokens.extend(tokens)
    t.parents.extend(parents)
    t.probs.extend(probs)
    t.sources.extend(bits)
    out.match_len = match_len
    out.expected_accepted = expected_accepted
    out.pld_match_len = pld_match_len
    out.learned_match_len = learned_match_len


def info_message(info: ServiceInfo) -> draft_pb2.InfoReply:
    return draft_pb2.InfoReply(
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        tokenizer_name=info.tokenizer_name,
        vocab_size=info.vocab_size,
        n_tokens=info.n_tokens,
        n_docs=info.n_docs,
        n_shards=info.n_shards,
        corpora=[draft_pb2.Corpus(name=name, n_docs=int(v.get("n_docs", 0)),
                                  n_tokens=int(v.get("n_tokens", 0)))
                 for name, v in sorted(info.corpora.items())],
        format_version=info.format_version,
        manifest_json=json.dumps(info.manifest, default=str, sort_keys=True),
        learn=info.learn,
        limits=draft_pb2.Limits(**{k: int(info.limits.get(k, 0)) for k in LIMITS}),
    )


def stats_message(stats: dict[str, Any]) -> draft_pb2.StatsReply:
    """The Stats reply of a server's counters (`ServiceStats.snapshot`): the fields the
    message names, and all of them as JSON."""
    return draft_pb2.StatsReply(
        **{k: stats.get(k, 0) for k in STATS_FIELDS},
        stats_json=json.dumps(stats, sort_keys=True),
    )


def put_results(reply: draft_pb2.BatchReply, sequences: Sequence[str],
                errors: Sequence[Refusal | None], rows: Sequence[int | None],
                trees: FlatTrees | None, context_lens: Sequence[int]) -> None:
    """The entries' results into `reply`, one per entry in order: a failed one carries its
    status and message only; one that drafted, its row `rows[i]` of `trees` (its node
    count, match lengths and expected accepted tokens) and of `context_lens`; a close (row
    None), nothing more. Rows are among the first len(context_lens), read as lists (one
    conversion per call, not one per field and row)."""
    n = len(context_lens)
    nodes = match_lens = expected = ()
    if trees is not None and n:
        nodes = trees.sizes()[:n].tolist()
        match_lens = trees.match_lens[:n].tolist()
        expected = trees.expected[:n].tolist()
    add = reply.results.add
    for sequence, error, i in zip(sequences, errors, rows):
        if error is not None:
            add(sequence=sequence, code=error.code.value[0], message=error.message)
        elif i is None:
            add(sequence=sequence)
        else:
            rest, pld, learned = match_lens[i]
            add(sequence=sequence, nodes=nodes[i], context_len=context_lens[i],
                match_len=rest, pld_match_len=pld, learned_match_len=learned,
                expected_accepted=expected[i])


def put_trees(reply: draft_pb2.BatchReply, trees: FlatTrees) -> None:
    """Every row's nodes, concatenated in row order, as the packed arrays."""
    t = reply.trees
    t.tokens = trees.tokens.astype("<u4", copy=False).tobytes()
    t.parents = trees.parents.astype("<i4", copy=False).tobytes()
    t.probs = trees.probs.astype("<f4", copy=False).tobytes()
    t.sources = trees.bits.astype(np.uint8, copy=False).tobytes()


def put_step_results(results: draft_pb2.PackedResults, nodes: np.ndarray,
                     context_lens: np.ndarray, match_lens: np.ndarray, expected: np.ndarray,
                     errors: dict[int, Refusal]) -> None:
    """The packed steps' results (one row per step; `match_lens` (n, 3)) into `results`,
    the failed steps listed sparsely with their status and message (their context length
    goes as 0, as documented)."""
    lens = context_lens.astype("<u8", copy=bool(errors))  # failed rows are zeroed
    if errors:
        failed = sorted(errors)
        lens[failed] = 0
        results.failed.extend(failed)
        results.failed_codes.extend(errors[i].code.value[0] for i in failed)
        results.failed_messages.extend(errors[i].message for i in failed)
    results.nodes = nodes.astype("<u4", copy=False).tobytes()
    results.context_lens = lens.tobytes()
    results.match_lens = match_lens.astype("<u4", copy=False).tobytes()
    results.expected_accepted = expected.astype("<f4", copy=False).tobytes()


# ---- replies: messages -> values (the client) -------------------------------------------


def tree_value(reply: draft_pb2.DraftReply) -> Tree:
    """Proto DraftReply -> Tree (sources as 'rest', 'pld', 'pld+rest'), 1:1: where a
    reply's source bits become the labels a Tree carries, and where it is checked.

    A reply whose tree is not a valid tree (arrays of different lengths, a missing
    probability, a parent after its child) is a server error, never filled in.
    """
    t = reply.tree
    draft = Tree(
        tokens=list(t.tokens),
        parents=list(t.parents),
        probs=list(t.probs),
        sources=[SOURCE_LABELS[s & 7] for s in t.sources],
        match_len=int(reply.match_len),
    )
    try:
        draft.validate()
    except ValueError as exc:
        raise ServiceError(f"the draft service sent a malformed tree: {exc}") from None
    return draft


def draft_value(reply: draft_pb2.DraftReply) -> Drafted:
    """A reply's draft (its tree checked by `tree_value`)."""
    return Drafted(tree_value(reply), int(reply.match_len), int(reply.pld_match_len),
                   int(reply.learned_match_len), float(reply.expected_accepted))


def info_value(r: draft_pb2.InfoReply) -> ServiceInfo:
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
        limits={k: getattr(r.limits, k) for k in LIMITS},
        manifest=json.loads(r.manifest_json) if r.manifest_json else {},
    )


def stats_value(r: draft_pb2.StatsReply) -> dict[str, Any]:
    """The server's counters (the reply's JSON holds every field and more)."""
    return json.loads(r.stats_json)


def batch_results(reply: draft_pb2.BatchReply, address: str,
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
        errors.append(None if code == 0 else error_for(STATUS.get(code), r.message, address))
        counts[i] = r.nodes
        context_lens.append(r.context_len)
        match_lens += (r.match_len, r.pld_match_len, r.learned_match_len)
        expected.append(r.expected_accepted)
    mls, exp = np.array(match_lens, np.int64), np.array(expected, np.float64)
    if steps is not None:
        step_counts, step_mls, step_exp = _step_results(reply.steps, steps, address,
                                                        sequences, errors, context_lens)
        counts = np.concatenate([counts, step_counts])
        mls = np.concatenate([mls, step_mls])
        exp = np.concatenate([exp, step_exp])
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    t = reply.trees
    n = int(offsets[-1])
    arrays = (np.frombuffer(t.tokens, "<u4"), np.frombuffer(t.parents, "<i4"),
              np.frombuffer(t.probs, "<f4"), np.frombuffer(t.sources, np.uint8))
    if any(len(a) != n for a in arrays):
        raise ServiceError(f"draft service {address}: the batch reply's trees hold "
                           f"{[len(a) for a in arrays]} nodes, its results {n}")
    return BatchResults(sequences, errors, context_lens,
                        FlatTrees(offsets, *arrays, mls.reshape(-1, 3), exp),
                        float(reply.server_us))


def _step_results(r: draft_pb2.PackedResults, steps: PackedSteps, address: str,
                  sequences: list, errors: list, context_lens: list
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The packed steps' results appended to the lists; returns their node counts, match
    lengths (3 a step, flat) and expected accepted tokens."""
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
        errors[first + i] = error_for(STATUS.get(code), message, address)
    context_lens += lens.tolist()
    return nodes.astype(np.int64), mls.astype(np.int64), exp.astype(np.float64)
