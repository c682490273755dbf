"""`draft-model`: an independent causal LM drafting autoregressively, with its own KV cache.

What `--draft-model` names (`draft_model`):

- a model name (anything `load_model` resolves): it must share the target's tokenizer, which
  is checked by fingerprint before the model is loaded;
- `int8`: the target with every linear layer in int8 (on the lean int8 decoder where the
  architecture allows, else module by module): the same weights with cheaper arithmetic;
- `skip:L`: the target's first L decoder layers, its final norm and LM head, sharing the
  target's weights (no copy): an early exit without training.

Each step the draft model first catches up with what the target accepted (its cache keeps
the longest prefix it shares with the context; the rest is fed in one forward, whose last row
already predicts the first draft token), then drafts greedily: a chain of its top-1 tokens,
plus its next best tokens as siblings at the first `branch_steps` depths (a tree of its top-k
at the first steps). Proposals are deterministic, so recursive rejection sampling stays exact.

How deep to draft is decided here, because drafting time is spent before the budget sees the
tree: one more draft forward is worth it while the chance that its token is accepted exceeds
the tokens the whole loop produces in the time that forward takes. The drafter measures both
sides itself: its forward time, and the loop's tokens per second between its `propose`
calls (the step's wall clock, its own drafting included). Its probabilities are scaled by how
often its chain has really matched what the target produced. A draft model too slow or too
wrong for its forward to pay drafts nothing (probing now and then to notice a change).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from redraft.decoder.drafter import Drafter, UnknownDrafter
from redraft.decoder.models.early_exit import first_layers
from redraft.decoder.models.int8 import quantized_int8
from redraft.decoder.models.int8_decoder import Int8Decoder, lean_int8
from redraft.decoder.models.loading import load_model
from redraft.decoder.verify import TreeVerifier
from redraft.proto.errors import RedraftError
from redraft.proto.models import load_tokenizer, tokenizer_fingerprint
from redraft.proto.tree import DEFAULT_MAX_DEPTH, Tree

SOURCE = "draft-model"  # the chain of top-1 tokens
ALT_SOURCE = "draft-model-alt"  # the top-k siblings: calibrated apart, they hit far less often
DECAY = 0.9  # weight of the past in the running estimates (a few dozen steps of memory)
PROBE_EVERY = 8  # steps between drafts when drafting does not pay, to notice a change
COLD_VALUE = 0.3  # tokens a draft forward's time is worth before any step was measured
CHUNK = 64  # rows per call when the draft model catches up with a long context


# -- what --draft-model names ------------------------------------------------------------

INT8 = "int8"
SKIP = "skip"


def parse_spec(spec: str) -> tuple[str, int | None]:
    """("int8", None), ("skip", L) or ("name", None); a malformed skip:L is an error."""
    spec = spec.strip()
    if not spec:
        raise UnknownDrafter("--draft-model needs a value: int8, skip:L or a model name")
    if spec.lower() == INT8:
        return INT8, None
    if spec.lower().startswith(SKIP + ":"):
        value = spec.split(":", 1)[1]
        if not value.isdigit() or int(value) < 1:
            raise UnknownDrafter(f"--draft-model {spec}: skip:L needs a layer count L >= 1")
        return SKIP, int(value)
    return "name", None


def check_tokenizer(name: str, target_tokenizer) -> None:
    """Refuse a draft model whose token ids mean something else than the target's."""
    try:
        theirs = tokenizer_fingerprint(load_tokenizer(name))
    except RedraftError as exc:
        raise UnknownDrafter(f"draft model {name!r}: {exc}") from None
    ours = tokenizer_fingerprint(target_tokenizer)
    if theirs != ours:
        raise UnknownDrafter(f"draft model {name!r} has another tokenizer than the target "
                             f"(fingerprint {theirs} vs {ours}); it must share the target's")


def draft_model(spec: str, load_target: Callable[[], Any], target_tokenizer):
    """The draft model a `--draft-model` value names, in eval mode.

    The target is loaded (`load_target()`) only after the value and the tokenizer check out.
    A named model goes on the target's device, in its dtype.
    """
    kind, layers = parse_spec(spec)
    if kind == "name":
        check_tokenizer(spec, target_tokenizer)
    target = load_target()
    if kind == INT8:
        return lean_int8(target) or quantized_int8(target)
    if kind == SKIP:
        return first_layers(target, layers)
    p = next(target.parameters())
    return load_model(spec, device=str(p.device), dtype=p.dtype)[0]


# -- the drafter -----------------------------------------------------------------------------


def _ema(old: float | None, new: float) -> float:
    return new if old is None else DECAY * old + (1.0 - DECAY) * new


class DraftModelDrafter(Drafter):
    """Drafts with `model` (sharing the target's tokenizer) as a chain with top-k siblings."""

    name = "draft-model"

    def __init__(self, model, max_depth: int = DEFAULT_MAX_DEPTH, top_k: int = 2,
                 branch_steps: int = 1, vocab_size: int | None = None,
                 min_prob: float = 0.02, depth: int = 0, packed_kernels: bool = True) -> None:
        self.depth = depth  # > 0: always draft this deep instead of choosing from costs
        self.runner = model if isinstance(model, Int8Decoder) else ModelRunner(model,
                                                                             packed_kernels)
        self.max_depth = max_depth
        self.top_k = max(1, top_k)
        self.branch_steps = branch_steps
        self.min_prob = min_prob
        self.vocab = int(vocab_size or model.config.vocab_size)
        self._cached: list[int] = []  # the tokens whose keys/values the draft cache holds
        self._forward_seconds: float | None = None  # one draft forward
        self._step_seconds: float | None = None  # one step of the whole loop
        self._step_tokens: float | None = None  # tokens one step of the loop produces
        self._hits, self._expected = 1.0, 1.0  # chain tokens matched vs predicted
        self._first_prob: float | None = None  # the first draft token's probability
        self._last_propose: float | None = None
        self._chain: list[int] = []
        self._paths: list[float] = []
        self._idle = 0

    # -- the value of a draft forward --------------------------------------------------

    @property
    def trust(self) -> float:
        """How far the draft's own path probabilities are borne out by the target."""
        return self._hits / self._expected

    def forward_value(self) -> float:
        """Tokens the loop produces in the time one draft forward takes."""
        if self._forward_seconds is None or not self._step_seconds or not self._step_tokens:
            return COLD_VALUE
        return self._step_tokens / self._step_seconds * self._forward_seconds

    def _worth(self, expected_tokens: float, depth: int = 0) -> bool:
        if self.depth:
            return depth < self.depth
        return expected_tokens * self.trust >= self.forward_value()

    # -- drafting --------------------------------------------------------------------------

    def begin(self, prompt: Sequence[int]) -> None:
        self._last_propose = None  # the gap since the last generation is not a step
        self._chain, self._paths = [], []

    def propose(self, context: Sequence[int], budget: int) -> Tree:
        now = time.perf_counter()
        if self._last_propose is not None:
            self._step_seconds = _ema(self._step_seconds, now - self._last_propose)
        self._last_propose = now
        self._chain, self._paths = [], []
        tree = Tree()
        if budget <= 0:
            return tree
        if self._first_prob is not None and not self._worth(self._first_prob, 0):
            self._idle += 1
            if self._idle % PROBE_EVERY:
                return tree
        self._idle = 0
        logits = self._catch_up(context)
        parent, path = -1, 1.0
        for depth in range(1, self.max_depth + 1):
            k = self.top_k if depth <= self.branch_steps else 1
            probs, ids = torch.topk(torch.softmax(logits[: self.vocab].float(), -1), k)
            probs, ids = probs.tolist(), ids.tolist()
            if depth == 1:
                self._first_prob = _ema(self._first_prob, probs[0])
            node = self._add(tree, ids[0], parent, probs[0], SOURCE)
            for tok, p in zip(ids[1:], probs[1:]):
                if path * p >= self.min_prob and len(tree) < budget:
                    self._add(tree, tok, parent, p, ALT_SOURCE)
            path *= probs[0]
            self._chain.append(ids[0])
            self._paths.append(path)
            if len(tree) >= budget or depth == self.max_depth:
                break
            if not self._worth(path * probs[0], depth):  # the next token's chance, roughly
                break
            logits = self._forward([ids[0]])
            parent = node
        return tree

    @staticmethod
    def _add(tree: Tree, token: int, parent: int, prob: float, source: str) -> int:
        tree.tokens.append(int(token))
        tree.parents.append(parent)
        tree.probs.append(min(1.0, max(0.0, float(prob))))
        tree.sources.append(source)
        return len(tree) - 1

    def update(self, accepted: Sequence[int]) -> None:
        """Learn the step's yield and how many of the chain's tokens the target produced."""
        self._step_tokens = _ema(self._step_tokens, float(len(accepted)))
        chain = self._chain
        if not chain:
            return
        n = min(len(chain), len(accepted))
        matched = 0
        while matched < n and chain[matched] == accepted[matched]:
            matched += 1
        # Chain position i was put to the test only if every earlier one matched.
        tested = min(n, matched + 1)
        self._hits = DECAY * self._hits + matched
        self._expected = DECAY * self._expected + sum(self._paths[:tested])

    def end(self) -> None:
        self._last_propose = None

    def close(self) -> None:
        self.runner.reset()
        self._cached = []

    # -- the draft model's cache --------------------------------------------------------

    def _catch_up(self, context: Sequence[int]) -> torch.Tensor:
        """Bring the cache to `context[:-1]` and feed `context[-1]`: the next-token logits.

        The cache keeps the longest prefix it shares with the context (drafts the target
        rejected, or the turns of a conversation that diverged, are cut off). A long catch-up
        (a new prompt) goes in chunks without logits, the very first token alone: int8
        activations share one scale per call, and the first token's outliers or hundreds of
        rows in one call would blur every row's.
        """
        cached = self._cached
        keep = min(len(cached), len(context) - 1)
        if cached[:keep] != list(context[:keep]):
            keep = next(i for i in range(keep) if cached[i] != context[i])
        if keep == 0:
            self.runner.reset()
        else:
            self.runner.truncate(keep)
        del cached[keep:]
        pending = list(context[keep:])
        if keep == 0 and len(pending) > 1:
            self._extend(pending[:1])
            pending = pending[1:]
        if len(pending) > CHUNK:
            for i in range(0, len(pending) - 1, CHUNK):
                self._extend(pending[i : min(i + CHUNK, len(pending) - 1)])
            pending = pending[-1:]
        return self._forward(pending)

    def _extend(self, tokens: list[int]) -> None:
        self.runner.extend(tokens)
        self._cached.extend(tokens)

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens (appended to the cache); the logits after the last one."""
        t0 = time.perf_counter()
        logits = self.runner.next_logits(tokens)
        self._cached.extend(tokens)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        # Averaged like the step time it is weighed against: load inflates both alike.
        self._forward_seconds = _ema(self._forward_seconds, time.perf_counter() - t0)
        return logits


class ModelRunner:
    """Any causal LM behind the interface `Int8Decoder` offers: a KV cache that `extend`
    appends to, `next_logits` appends to and answers from, and `truncate` rolls back."""

    def __init__(self, model, packed_kernels: bool = True) -> None:
        self.verifier = TreeVerifier(model, packed_kernels=packed_kernels)

    @property
    def cached_len(self) -> int:
        return self.verifier.cached_len

    def reset(self) -> None:
        self.verifier.reset()

    def truncate(self, length: int) -> None:
        self.verifier.truncate(length)

    def extend(self, tokens: Sequence[int]) -> None:
        self.verifier.extend(list(tokens))

    def next_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        out = self.verifier.tree_forward(tokens[0], Tree.chain(list(tokens[1:])), last=1)
        self.verifier.commit(list(range(len(tokens) - 1)))
        return out.logits[-1]


def make(ctx) -> DraftModelDrafter:
    top_k, steps = int(ctx.option("draft_top_k")), int(ctx.option("draft_branch_steps"))
    depth = int(ctx.option("draft_depth"))
    if top_k < 1 or steps < 0 or depth < 0:
        raise UnknownDrafter("--draft-top-k must be >= 1, --draft-branch-steps and "
                             "--draft-depth >= 0")
    if ctx.tokenizer is None:
        raise UnknownDrafter("the draft-model drafter needs the target's tokenizer")
    model = draft_model(str(ctx.option("draft_model")), lambda: ctx.model, ctx.tokenizer)
    vocab = min(int(model.config.vocab_size), int(ctx.model.config.vocab_size))
    return DraftModelDrafter(model, max_depth=ctx.max_depth, top_k=top_k, branch_steps=steps,
                             vocab_size=vocab, depth=depth)
