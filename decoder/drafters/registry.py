"""The drafter registry: every drafter by name, with its factory and its options.

A new drafter is one module under `redraft.decoder.drafters` with a `make(ctx)` factory plus
one `DrafterSpec` below. `--drafters`, the options of `redraft generate` / `redraft bench`
(each spec's options become command-line flags) and `build_drafter` all read this table, so
nothing else needs to learn a new name. Factories are imported (by name, through importlib)
only when a drafter is built: naming a drafter never loads another's dependencies.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redraft.decoder.drafter import (
    Drafter,
    MergedDrafter,
    UnknownDrafter,
)
from redraft.decoder.heads.committed import default_heads_path
from redraft.proto.tree import DEFAULT_MAX_DEPTH

NONE = "none"  # plain decoding through the same loop (the baseline); not a drafter


@dataclass(frozen=True)
class Option:
    """A drafter setting; `--NAME` on the command line, `options["NAME_WITH_UNDERSCORES"]`."""

    name: str
    help: str
    default: Any = None
    type: Callable[[str], Any] = str
    metavar: str | None = None

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    summary: str
    factory: str  # "module:function" taking a DrafterContext
    options: tuple[Option, ...] = ()
    needs_retrieval: bool = False  # needs a datastore or a draft service


@dataclass
class DrafterContext:
    """Everything a factory may use; a factory takes what it needs and ignores the rest.

    The model may come as `model_loader`, called on first use of `ctx.model`: drafters that
    need no model are then built (and their inputs checked) before the model is loaded.
    """

    tokenizer: Any = None
    model_name: str = ""
    datastore: str | None = None
    draft_service: str | None = None
    token: str | None = None
    max_depth: int = DEFAULT_MAX_DEPTH
    names: tuple[str, ...] = ()  # the whole combination being built
    options: dict[str, Any] = field(default_factory=dict)
    model_loader: Callable[[], Any] | None = None
    _model: Any = None
    tls: bool | str = False  # the draft service's: False, True (system roots) or a CA file

    @property
    def model(self) -> Any:
        if self._model is None and self.model_loader is not None:
            self._model = self.model_loader()
        return self._model

    def option(self, key: str) -> Any:
        """An option's value, its spec's default when not given."""
        if key in self.options and self.options[key] is not None:
            return self.options[key]
        for spec in REGISTRY.values():
            for opt in spec.options:
                if opt.key == key:
                    return opt.default
        raise KeyError(key)


REGISTRY: dict[str, DrafterSpec] = {
    spec.name: spec
    for spec in (
        DrafterSpec("pld", "prompt lookup in the prompt and the output so far",
                    "redraft.decoder.drafters.pld:make"),
        DrafterSpec("rest", "retrieval from a datastore (--datastore) or a draft service "
                    "(--draft-service), and outputs learned from earlier generations",
                    "redraft.decoder.drafters.rest:make", needs_retrieval=True, options=(
                        Option("learn", "also draft from earlier outputs: this process's "
                               "(--datastore) or the draft service's (on or off)", "on",
                               metavar="on|off"),
                        Option("learn-max-tokens", "tokens of outputs kept for learned "
                               "drafts in this process (--datastore)", 1_000_000, int, "N"),
                        Option("tenant", "tenant whose outputs the draft service learns "
                               "and drafts (without auth; with auth, a subdivision)", "",
                               metavar="NAME"),
                    )),
        DrafterSpec("suffix", "SuffixDecoding (arctic-inference): suffix trees of the prompt "
                    "and this process's earlier outputs, as vLLM's suffix method",
                    "redraft.decoder.drafters.suffix:make"),
        DrafterSpec("recycle", "token recycling: the target's own earlier top-k per token",
                    "redraft.decoder.drafters.recycle:make"),
        DrafterSpec("medusa", "Medusa heads on the target's last hidden state (a sparse tree "
                    "of their top-k guesses)", "redraft.decoder.drafters.medusa:make",
                    options=(
                        Option("medusa-heads", "heads file (default: the committed heads of "
                               "the model)", metavar="FILE"),
                        Option("medusa-projection", "LM projection of the heads: full or "
                               "subset (default: the one the heads file names)",
                               metavar="NAME"),
                    )),
        DrafterSpec("hybrid", "pld, rest (with a datastore or service), recycle and medusa "
                    "merged into one tree", "redraft.decoder.drafters.hybrid:make"),
        DrafterSpec("fallback", "the copying drafters' tree, or the Medusa heads' when the "
                    "retrieval hit rate is low", "redraft.decoder.drafters.fallback:make"),
        DrafterSpec("draft-model", "an independent draft model (--draft-model) drafting "
                    "autoregressively", "redraft.decoder.drafters.draft_model:make", (
                        Option("draft-model", "int8 (the target quantized to int8), skip:L "
                               "(the target's first L layers) or a model name sharing the "
                               "target's tokenizer", "int8", metavar="NAME"),
                        Option("draft-top-k", "the draft model's top-k drafted at each "
                               "branching depth (1 = a chain)", 2, int, "K"),
                        Option("draft-branch-steps", "depths that branch into the top-k",
                               1, int, "S"),
                        Option("draft-depth", "draft exactly D tokens deep each step (0 = "
                               "as deep as pays, from measured costs)", 0, int, "D"),
                    )),
        DrafterSpec("lookahead", "Lookahead decoding: n-grams from Jacobi iterations run "
                    "inside each verification forward", "redraft.decoder.drafters.lookahead:make", (
                        Option("lookahead-window", "W: Jacobi guesses per level", 3, int, "W"),
                        Option("lookahead-ngram", "N: n-gram size (N - 1 levels of guesses)",
                               4, int, "N"),
                        Option("lookahead-guesses", "G: pool n-grams verified per step at most",
                               6, int, "G"),
                    )),
    )
}


def known_names() -> str:
    return ", ".join([NONE, *REGISTRY])


def copying_drafters(retrieval: bool) -> str:
    """Every drafter that copies and needs nothing more than what was given (recycling and
    prompt lookup need no corpus; rest needs a datastore or service)."""
    return "pld,rest,recycle" if retrieval else "pld,recycle"


def default_drafters(retrieval: bool, model_name: str | None = None) -> str:
    """What runs when no drafter is named: `hybrid` (the copying drafters and the Medusa
    heads in one tree, the fastest on Spec-Bench once the heads ran in int8) where the model
    has committed heads, else the copying drafters."""
    return "hybrid" if default_heads_path(model_name) else copying_drafters(retrieval)


def parse_names(names: str | Sequence[str] | None) -> list[str]:
    """Validate a drafter name or comma-separated combination; default `pld,recycle`."""
    if names is None:
        names = copying_drafters(False)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = list(dict.fromkeys(n.lower() for n in names))
    if not names:
        raise UnknownDrafter(f"no drafter named (use {known_names()} or a combination)")
    for n in names:
        if n != NONE and n not in REGISTRY:
            raise UnknownDrafter(f"unknown drafter {n!r} (known: {known_names()}; "
                                 "combine with commas, e.g. pld,rest)")
    if NONE in names and len(names) > 1:
        raise UnknownDrafter(f"'{NONE}' cannot be combined with other drafters")
    return names


def build_drafter(
    names: str | Sequence[str] | None,
    *,
    model=None,
    model_loader: Callable[[], Any] | None = None,
    tokenizer=None,
    model_name: str = "",
    datastore: str | None = None,
    draft_service: str | None = None,
    token: str | None = None,
    max_depth: int = DEFAULT_MAX_DEPTH,
    options: dict[str, Any] | None = None,
    tls: bool | str = False,
) -> Drafter | None:
    """A drafter from a name or a comma-separated combination; None for `none`.

    Members are built in registry order (the order their trees are merged in); several are
    merged into one tree per step by `MergedDrafter`.
    """
    if names is None:
        names = default_drafters(bool(datastore or draft_service), model_name or None)
    names = parse_names(names)
    if names == [NONE]:
        return None
    ctx = DrafterContext(tokenizer, model_name, datastore, draft_service, token, max_depth,
                         tuple(names), dict(options or {}), model_loader, model, tls)
    drafters: list[Drafter] = []
    try:
        for name in REGISTRY:
            if name in names:
                module, func = REGISTRY[name].factory.split(":")
                drafters.append(getattr(importlib.import_module(module), func)(ctx))
    except BaseException:
        for d in drafters:
            d.close()
        raise
    return drafters[0] if len(drafters) == 1 else MergedDrafter(drafters)


def add_options(parser: argparse.ArgumentParser) -> None:
    """Every registered drafter's options as command-line flags, in one argument group."""
    group = None
    for spec in REGISTRY.values():
        for opt in spec.options:
            if group is None:
                group = parser.add_argument_group("drafter options")
            group.add_argument(f"--{opt.name}", dest=opt.key, type=opt.type, default=None,
                               metavar=opt.metavar,
                               help=f"[{spec.name}] {opt.help} (default: {opt.default})")


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The drafter options given on the command line (absent ones left to their defaults)."""
    out = {}
    for spec in REGISTRY.values():
        for opt in spec.options:
            value = getattr(args, opt.key, None)
            if value is not None:
                out[opt.key] = value
    return out


def service_credentials(args: argparse.Namespace) -> tuple[str | None, bool | str]:
    """A command's draft-service token (--token, --token-file or $REDRAFT_TOKEN) and TLS
    (--tls, --tls-ca) for `build_drafter`, checked before any model loads; none without
    --draft-service."""
    if not getattr(args, "draft_service", None):
        return None, False
    from redraft.datastore.service.client import (  # lazy: gRPC only for a service
        client_tls,
        client_token,
    )

    return client_token(args.token, args.token_file), client_tls(args.tls, args.tls_ca)
