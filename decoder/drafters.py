"""Drafters: anything that proposes a candidate tree for the next tokens.

The decoding loop only knows the small `Drafter` interface (DESIGN.md): `propose(context,
budget) -> Tree` plus optional per-generation hooks. Each source is one class:

- `PLDDrafter`: prompt lookup over the generation's own context, in process (no network).
- `DatastoreDrafter`: retrieval from a datastore opened in this process (`--datastore DIR`).
- `ServiceDrafter`: retrieval from the gRPC draft service, one session per generation; if
  the service cannot be reached or fails mid-generation, it switches to local drafting for
  the rest of that generation. Output never changes: drafts only affect speed.
- `RecycleDrafter`: token recycling, the target's own earlier top-k predictions per token
  (`decoder/recycle.py`); the one drafter that reads the verifier's logits (`observe`).
- `MergedDrafter`: several drafters' trees merged into one trie under the budget.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redraft.datastore.errors import RedraftError
from redraft.decoder.tree import Tree, merge

log = logging.getLogger("redraft.decoder")

DEFAULT_MAX_DEPTH = 16


class UnknownDrafter(RedraftError):
    """A drafter name that is not one of the known ones."""


class Drafter:
    """Base class: subclasses implement `propose`; the hooks default to doing nothing."""

    name = "drafter"
    failures = 0  # times this drafter gave up on its source (e.g. a dead draft service)
    candidates_wanted = 0  # > 0: the loop calls `observe` with the target's top-k per node

    def begin(self, prompt: Sequence[int]) -> None:
        """A generation starts with this context (prompt tokens)."""

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        """A tree of at most `budget` nodes continuing `context` (whose last token is the root)."""
        raise NotImplementedError

    def update(self, accepted: Sequence[int]) -> None:
        """Tokens appended to the context by the last step (accepted drafts + bonus)."""

    def observe(self, context: Sequence[int], tree: Tree, ids, probs) -> None:
        """The target's top-k next tokens (ids, probs: arrays [len(tree) + 1, k]) after the
        context (row 0; its last token was the root) and after each node of the tree just
        verified (row i + 1). Only called when `candidates_wanted` > 0."""

    def end(self) -> None:
        """The generation is over (release sessions)."""

    def close(self) -> None:
        """Release files and connections for good."""


class PLDDrafter(Drafter):
    """Prompt lookup over prompt + output so far, with an incremental n-gram index."""

    name = "pld"

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, **lookup_kwargs) -> None:
        from redraft.datastore.pld import PromptLookup

        self._factory = lambda: PromptLookup(**lookup_kwargs)
        self.max_depth = max_depth
        self._lookup = self._factory()

    def begin(self, prompt: Sequence[int]) -> None:
        self._lookup = self._factory()
        self._lookup.extend(prompt)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        lookup = self._lookup
        n = len(lookup)
        if n > len(context) or (n and lookup.tokens[-1] != context[n - 1]):
            # Out of step with the caller's context (e.g. reused without begin): rebuild.
            self._lookup = lookup = self._factory()
        if len(lookup) < len(context):
            lookup.extend(context[len(lookup) :])
        return Tree.from_draft(lookup.propose(budget=budget, max_depth=self.max_depth))


class RecycleDrafter(Drafter):
    """Token recycling: drafts from the target's own top-k predictions seen after each token.

    The table is kept across generations (it is what this model says, not what a prompt
    says), so one drafter should serve one model.
    """

    name = "recycle"

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, k: int = 8) -> None:
        from redraft.decoder.recycle import CandidateTable

        self.max_depth = max_depth
        self.candidates_wanted = k
        self.table = CandidateTable(k)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        return self.table.draft(int(context[-1]), budget, self.max_depth)

    def observe(self, context: Sequence[int], tree: Tree, ids, probs) -> None:
        self.table.record([int(context[-1]), *tree.tokens], ids, probs)


class MergedDrafter(Drafter):
    """One tree from several drafters: shared prefixes merged, best path probabilities kept.

    A member that raises is dropped for the rest of the generation (and counted in
    `failures`); the others keep drafting.
    """

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        self.drafters = list(drafters)
        self.name = ",".join(d.name for d in self.drafters)
        self._live = list(self.drafters)
        self._own_failures = 0

    def _call(self, d: Drafter, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:  # drafts are optional: lose one source, not the others
            self._own_failures += 1
            self._live = [x for x in self._live if x is not d]
            log.warning("drafter %s failed (%s); continuing without it", d.name, exc)
            return None

    def begin(self, prompt: Sequence[int]) -> None:
        self._live = list(self.drafters)
        for d in list(self._live):
            self._call(d, d.begin, prompt)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        trees = []
        for d in list(self._live):
            tree = self._call(d, d.propose, context, budget)
            if tree is not None and len(tree):
                trees.append(tree)
        if not trees:
            return Tree()
        if len(trees) == 1:
            return trees[0].prune(budget)
        return merge(trees).prune(budget)

    def update(self, accepted: Sequence[int]) -> None:
        for d in list(self._live):
            self._call(d, d.update, accepted)

    @property
    def candidates_wanted(self) -> int:  # type: ignore[override]
        return max((d.candidates_wanted for d in self._live), default=0)

    def observe(self, context: Sequence[int], tree: Tree, ids, probs) -> None:
        for d in list(self._live):
            if d.candidates_wanted:
                self._call(d, d.observe, context, tree, ids, probs)

    def end(self) -> None:
        for d in self.drafters:
            try:
                d.end()
            except Exception as exc:  # ending must not fail a finished generation
                log.warning("drafter %s failed to end (%s)", d.name, exc)

    def close(self) -> None:
        for d in self.drafters:
            d.close()

    @property
    def failures(self) -> int:  # type: ignore[override]
        return self._own_failures + sum(d.failures for d in self.drafters)


class DatastoreDrafter(Drafter):
    """Retrieval from a datastore opened in this process (no server needed)."""

    name = "rest"

    def __init__(self, path: str, tokenizer=None, max_depth: int = DEFAULT_MAX_DEPTH,
                 corpora: Sequence[str] | None = None) -> None:
        from redraft.datastore.reader import Reader

        self.reader = Reader(path)
        if tokenizer is not None:
            try:
                self.reader.check_tokenizer(tokenizer)
            except BaseException:
                self.reader.close()
                raise
        self.max_depth = max_depth
        self.corpora = list(corpora) if corpora else None

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        draft = self.reader.propose(
            context, budget=budget, max_depth=self.max_depth, corpora=self.corpora
        )
        return Tree.from_draft(draft)

    def close(self) -> None:
        self.reader.close()


class ServiceDrafter(Drafter):
    """Retrieval drafts from the gRPC draft service: one streaming session per generation.

    The session sends only the tokens appended since the previous step. Any failure
    (unreachable server, timeout, server error, a session ended mid-generation) closes the
    session and hands the rest of the generation to `fallback` (local drafting; None means
    no drafts from this source). Output cannot change: drafts only decide speed.
    """

    name = "rest"

    def __init__(
        self,
        address: str,
        fingerprint: str,
        fallback: Drafter | None = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
        token: str | None = None,
        timeout: float = 1.0,
        sources: Sequence[str] = ("rest",),
    ) -> None:
        from redraft.datastore.client import DraftClient

        self.address = address
        self.fingerprint = fingerprint
        self.fallback = fallback
        self.max_depth = max_depth
        self.sources = tuple(sources)
        self.client = DraftClient(address, token=token, timeout=timeout)
        self.failures = 0
        self._session = None
        self._sent = 0
        self._first = None
        self._failed = False

    def check(self) -> None:
        """Raise TokenizerMismatch now if the server's datastore uses another tokenizer.

        An unreachable server is not an error here: generation falls back to local drafts.
        """
        from redraft.datastore.client import ServiceError
        from redraft.datastore.errors import TokenizerMismatch

        try:
            info = self.client.info()
        except ServiceError as exc:
            log.warning("draft service %s unavailable (%s); using local drafts", self.address, exc)
            return
        if info.tokenizer_fingerprint != self.fingerprint:
            raise TokenizerMismatch(
                f"draft service {self.address} serves a datastore built with tokenizer "
                f"{info.tokenizer_name or '?'} ({info.tokenizer_fingerprint}); this model's "
                f"tokenizer is {self.fingerprint}"
            )

    def begin(self, prompt: Sequence[int]) -> None:
        from redraft.datastore.client import DraftParams

        self._close_session()
        self._failed = False
        self._first = None
        try:
            params = DraftParams(max_depth=self.max_depth, sources=self.sources)
            self._session = self.client.session(list(prompt), params, self.fingerprint)
            self._first = Tree.from_draft(self._session.open())
            self._sent = len(prompt)
        except Exception as exc:  # any failure: local drafting for this generation
            self._fail(exc, prompt)

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        if self._failed or self._session is None:
            if not self._failed:
                self._fail(RuntimeError("no open session"), context)
            return self.fallback.propose(context, budget) if self.fallback else Tree()
        try:
            if self._first is not None and self._sent == len(context):
                tree, self._first = self._first, None
                return tree.prune(budget)
            self._first = None
            draft = self._session.step(list(context[self._sent :]), budget=budget)
            self._sent = len(context)
            return Tree.from_draft(draft)
        except Exception as exc:
            self._fail(exc, context)
            return self.fallback.propose(context, budget) if self.fallback else Tree()

    def end(self) -> None:
        self._close_session()
        if self._failed and self.fallback is not None:
            self.fallback.end()

    def close(self) -> None:
        self._close_session()
        self.client.close()

    def _fail(self, exc: BaseException, context: Sequence[int]) -> None:
        self.failures += 1
        self._failed = True
        self._close_session()
        log.warning("draft service %s failed (%s); continuing with local drafts",
                    self.address, exc)
        if self.fallback is not None:
            self.fallback.begin(context)

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                session.close()
            except Exception:  # closing a broken stream must not raise
                pass


KNOWN_DRAFTERS = ("none", "pld", "rest", "recycle")


def default_drafters(retrieval: bool) -> str:
    """What runs when no drafter is named: every drafter that needs nothing more than what
    was given (recycling and prompt lookup need no corpus; rest needs a datastore or service).
    """
    return "pld,rest,recycle" if retrieval else "pld,recycle"


def parse_names(names: str | Sequence[str] | None) -> list[str]:
    """Validate a drafter name or comma-separated combination; default `pld,recycle`."""
    if names is None:
        names = default_drafters(False)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = list(dict.fromkeys(n.lower() for n in names))
    if not names:
        raise UnknownDrafter("no drafter named (use none, pld, rest, recycle or a combination)")
    for n in names:
        if n == "medusa":
            raise UnknownDrafter("drafter 'medusa' is not available yet (no trained heads)")
        if n not in KNOWN_DRAFTERS:
            raise UnknownDrafter(f"unknown drafter {n!r} (known: none, pld, rest, recycle; "
                                 "combine with commas, e.g. pld,rest)")
    if "none" in names and len(names) > 1:
        raise UnknownDrafter("'none' cannot be combined with other drafters")
    return names


def build_drafter(
    names: str | Sequence[str] | None,
    *,
    tokenizer=None,
    datastore: str | None = None,
    draft_service: str | None = None,
    token: str | None = None,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Drafter | None:
    """A drafter from a name or a comma-separated combination (none, pld, rest, recycle).

    `rest` reads `datastore` in process, or asks `draft_service` (PLD always runs locally:
    it needs no corpus and a network round trip would cost more than the lookup).
    """
    names = parse_names(names)
    if names == ["none"]:
        return None
    drafters: list[Drafter] = []
    if "pld" in names:
        drafters.append(PLDDrafter(max_depth=max_depth))
    if "rest" in names:
        if datastore and draft_service:
            raise UnknownDrafter("give either a datastore or a draft service, not both")
        if datastore:
            drafters.append(DatastoreDrafter(datastore, tokenizer, max_depth=max_depth))
        elif draft_service:
            from redraft.datastore.tokenizer import tokenizer_fingerprint

            fallback = None if "pld" in names else PLDDrafter(max_depth=max_depth)
            service = ServiceDrafter(draft_service, tokenizer_fingerprint(tokenizer), fallback,
                                     max_depth=max_depth, token=token)
            service.check()
            drafters.append(service)
        else:
            raise UnknownDrafter("drafter 'rest' needs a datastore (--datastore DIR) or a "
                                 "draft service (--draft-service ADDR)")
    if "recycle" in names:
        drafters.append(RecycleDrafter(max_depth=max_depth))
    return drafters[0] if len(drafters) == 1 else MergedDrafter(drafters)
