"""The decoding loop and the `Generator` API.

Stages, named as in gpt-fast: `prefill` puts the prompt into the KV cache; every later step
is `speculative_decode` (draft a tree, verify it in one forward, accept a path + a bonus
token). Plain decoding is the same step with an empty tree, so the baseline runs through
exactly the same code.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from redraft.decoder.acceptance import Acceptance, SamplingParams, accept, top_candidates
from redraft.decoder.budget import CostModel
from redraft.decoder.drafter import Drafter, MergedDrafter
from redraft.decoder.policy import Calibrator, calibration_path
from redraft.decoder.text import IncrementalText, StopStrings, chat_ids, unencodable
from redraft.decoder.verify import TreeVerifier
from redraft.proto.errors import RedraftError
from redraft.proto.files import cache_root
from redraft.proto.tree import DEFAULT_MAX_DEPTH, Tree, join

log = logging.getLogger("redraft.decoder")


class GenerationError(RedraftError):
    """Bad generation input: empty or too-long prompt, max_new_tokens <= 0, bad sampling."""


SEEDS = 1 << 64  # what a torch generator's seed holds


def check_seed(seed) -> int:
    """The sampling seed as an int in [0, 2**64) (None: 0), else GenerationError."""
    if seed is None:
        return 0
    try:
        value = operator.index(seed)  # ints and numpy integers, never a float
    except TypeError:
        value = -1
    if not 0 <= value < SEEDS:
        raise GenerationError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return value


def check_text(text: str, what: str = "prompt") -> None:
    """GenerationError if `text` cannot be tokenized (see `unencodable`)."""
    why = unencodable(text)
    if why is not None:
        raise GenerationError(f"{what} is {why}")


@dataclass
class GenerationStats:
    """What one generation cost and how well drafting worked."""

    prompt_tokens: int = 0
    steps: int = 0  # target forwards after prefill
    new_tokens: int = 0
    seconds: float = 0.0  # decoding time, prefill excluded
    prefill_seconds: float = 0.0
    forward_seconds: float = 0.0  # of `seconds`, the time inside the target's forwards
    packed_forwards: int = 0  # target forwards (prefill included) that ran on packed kernels
    drafted: int = 0  # tree nodes verified
    draft_seconds: float = 0.0  # time inside the drafter's calls (propose and hooks)
    accepted: dict[str, int] = field(default_factory=dict)  # accepted draft tokens per source
    # verified nodes whose parent was accepted, per source: accepted / tried is its acceptance
    tried: dict[str, int] = field(default_factory=dict)
    drafter_errors: int = 0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tokens_per_step"] = round(self.tokens_per_step, 4)
        out["tokens_per_second"] = round(self.tokens_per_second, 3)
        return out


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids (the EOS token included when it ended the generation)
    text: str
    stats: GenerationStats
    finish_reason: str  # "length", "eos" or "stop"
    prompt_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "finish_reason": self.finish_reason,
                "stats": self.stats.to_dict()}


# -- stages --------------------------------------------------------------------------------


def prefill(verifier: TreeVerifier, ids: Sequence[int]) -> int:
    """Cache every prompt token but the last, which becomes the first step's root."""
    verifier.prefill(list(ids[:-1]))
    return int(ids[-1])


def speculative_decode(
    verifier: TreeVerifier,
    root: int,
    tree: Tree,
    params: SamplingParams,
    generator: torch.Generator,
    candidates: int = 0,
    hidden: bool = False,
    side: Tree | None = None,
) -> Acceptance:
    """One target forward over root + tree, acceptance, and cache compaction.

    `candidates` > 0 also returns the target's top-k next tokens after root and every node
    (what token recycling keeps of the forward instead of throwing it away); `hidden` the
    final hidden state of the last accepted row (what Medusa heads draft from). `side` rows
    (a drafter's own, see `Drafter.side_rows`) join the forward after the tree, are never
    accepted, leave the cache with the rejected nodes, and their top-k comes back in
    `acc.side` (at least the top 1).
    """
    n = len(tree) + 1
    out = verifier.tree_forward(root, join(tree, side) if side else tree)
    logits = out.logits[:n]
    acc = accept(logits, tree, params, generator)
    verifier.commit(acc.nodes)
    if candidates:
        acc.candidates = top_candidates(logits, candidates)
    if side:
        acc.side = top_candidates(out.logits[n:], max(1, candidates))
    if hidden and out.hidden is not None:
        acc.hidden = out.hidden[acc.nodes[-1] + 1 if acc.nodes else 0]
    return acc


# -- the generator ---------------------------------------------------------------------------


@dataclass
class _Run:
    """One generation in progress: what the loop's stages read and update."""

    ids: list[int]  # the prompt
    max_new: int
    params: SamplingParams
    sampler: torch.Generator
    eos_ids: set[int]
    stats: GenerationStats
    drafter: Drafter | None
    cost: CostModel | None  # None without a drafter
    text: IncrementalText
    stops: StopStrings
    context: list[int]  # prompt + output so far
    packed_before: int
    root: int = 0  # the last token, not yet in the cache
    drafting: bool = False  # the drafter is started and has not failed
    out: list[int] = field(default_factory=list)
    shown: list[str] = field(default_factory=list)  # text pieces released so far
    finish: str = "length"
    started: float = 0.0
    failures_before: int = 0

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.out)


class TextStream:
    """Iterates over text pieces as tokens are accepted; `.result` is set when it ends.

    The pieces joined are exactly `result.text`: text that may begin a stop string is held
    back until it is known not to, and nothing after a stop string is ever yielded.
    """

    def __init__(self, steps: Iterator[tuple[list[int], str]]) -> None:
        self._steps = steps
        self.result: GenerationResult | None = None

    def close(self) -> None:
        """Stop early and free the Generator for its next generation."""
        self._steps.close()

    def __iter__(self) -> Iterator[str]:
        shown = 0
        while True:
            try:
                _, piece = next(self._steps)
            except StopIteration as stop:
                self.result = stop.value
                break
            if piece:
                shown += len(piece)
                yield piece
        if len(self.result.text) > shown:
            yield self.result.text[shown:]  # what was held back until the end


class Generator:
    """A target model + tokenizer + drafter, with lossless `generate` and `stream`.

    `drafter=None` is plain decoding through the same loop. The cost curve for tree sizes is
    measured on first use (and cached on disk) unless one is given. `persist_state=True`
    keeps what decoding learns (the calibration, the drafter's state: `save_state`) under the
    cache root across processes, as `redraft generate` does; a path keeps it in that folder.

    Thread-safe by serializing: one Generator runs one generation at a time (its KV cache,
    drafter and calibration belong to that generation). A call from another thread waits
    for the running one to finish; a `stream` or `iter_steps` holds the Generator until it is
    exhausted or closed. Starting a second generation in the thread that still holds an
    unfinished one raises GenerationError (waiting would never end). For parallel
    generations, make one Generator per thread (they may share the model).
    """

    def __init__(
        self,
        model,
        tokenizer,
        drafter: Drafter | Sequence[Drafter] | None = None,
        *,
        model_name: str = "model",
        cost: CostModel | None = None,
        max_nodes: int | None = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
        persist_state: bool | str | os.PathLike = False,
        packed_kernels: bool = True,
        choose_kernels: bool = True,
        block_weights: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        if isinstance(drafter, Sequence) and not isinstance(drafter, Drafter):
            drafter = (
                None if not drafter else drafter[0] if len(drafter) == 1 else MergedDrafter(drafter)
            )
        if drafter is not None:  # drafts in another tokenizer's ids are refused here
            drafter.check_tokenizer(tokenizer)
        self.drafter: Drafter | None = drafter
        self.model_name = model_name
        self._cost = cost
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.calibrator = Calibrator()
        # Seconds each step spends outside the target's forward (drafting, acceptance, cache
        # compaction), learned online: the budget adds it to the cost curve's forward times.
        self.step_overhead = 0.0
        # With persistence, a new process starts from what earlier runs learned (how often
        # each drafter's guesses are accepted, the drafter's own state) instead of from a
        # prior; `save_state` keeps it at the end of every generation.
        self.state_dir: Path | None = None
        if persist_state and drafter is not None:
            self.state_dir = cache_root() if persist_state is True else Path(persist_state)
            self.load_state()
        self.verifier = TreeVerifier(model, packed_kernels, choose_kernels,
                                     block_weights=block_weights)
        self.context_limit = _context_limit(model)
        self.eos_ids = _eos_ids(model, tokenizer)
        self._busy = threading.Lock()  # held for a whole generation (see the class docstring)
        self._holder: int | None = None  # the thread running it

    # -- what is learned across processes ------------------------------------------------

    def load_state(self) -> None:
        """Read the calibration and the drafter's state (`Drafter.load_state`) from
        `state_dir`; what is missing or damaged is ignored. Called when the Generator is made
        with `persist_state`."""
        if self.state_dir is None or self.drafter is None:
            return
        self.calibrator.load(calibration_path(self.model_name, self.drafter.name,
                                              self.state_dir))
        self.drafter.load_state(self.state_dir, self.model_name,
                                int(self.model.config.vocab_size))

    def save_state(self) -> None:
        """Write the calibration and the drafter's state (`Drafter.save_state`) to
        `state_dir`. Called at the end of every generation (also one closed or failed
        early); a drafter that fails to save is logged, never raised: the answer stands."""
        if self.state_dir is None or self.drafter is None:
            return
        self.calibrator.save(calibration_path(self.model_name, self.drafter.name,
                                              self.state_dir))
        try:
            self.drafter.save_state(self.state_dir, self.model_name)
        except Exception as exc:  # state only buys the next process a head start
            log.warning("drafter %s failed to save its state (%s)", self.drafter.name, exc)

    @property
    def cost(self) -> CostModel:
        if self._cost is None:
            self._cost = CostModel.for_model(
                self.model, self.model_name, packed_kernels=self.verifier.kernels is not None,
                choose_kernels=self.verifier.choice is not None,
                block_weights=self.verifier.on_blocks,
            )
        return self._cost

    # -- input -------------------------------------------------------------------------

    def encode(self, prompt, chat: bool | None = None) -> list[int]:
        """Prompt ids from ids, a string, or a list of chat messages ({'role', 'content'})."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise GenerationError("empty prompt")
            check_text(prompt)
            if chat is None:
                chat = bool(getattr(self.tokenizer, "chat_template", None))
            if chat:
                return self._chat_ids([{"role": "user", "content": prompt}])
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict):
            return self._chat_ids(list(prompt))
        ids = [int(t) for t in prompt]
        if not ids:
            raise GenerationError("empty prompt")
        vocab = int(self.model.config.vocab_size)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise GenerationError(f"prompt token id {bad[0]} outside the vocabulary (size {vocab})")
        return ids

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise GenerationError("this model's tokenizer has no chat template")
        if not any(str(m.get("content", "")).strip() for m in messages):
            raise GenerationError("empty prompt")
        for m in messages:
            check_text(str(m.get("content", "")), "a message")
        return chat_ids(self.tokenizer, messages)

    # -- decoding ----------------------------------------------------------------------

    def iter_steps(self, prompt, max_new_tokens: int = 128, **kwargs):
        """A Python generator yielding each step's new tokens; its return value (the
        StopIteration's `value`) is the GenerationResult. For custom loops, and for running
        several configurations in lock-step so machine noise hits them alike."""
        steps = self._run(prompt, max_new_tokens, **kwargs)
        try:
            while True:
                try:
                    tokens, _ = next(steps)
                except StopIteration as stop:
                    return stop.value
                yield tokens
        finally:
            steps.close()

    def generate(self, prompt, max_new_tokens: int = 128, **kwargs) -> GenerationResult:
        """Decode until max_new_tokens, EOS or a stop string; returns tokens, text and stats.

        `stop`: one stop string or a list of them; `seed`: an int in [0, 2**64)."""
        steps = self._run(prompt, max_new_tokens, **kwargs)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value

    def stream(self, prompt, max_new_tokens: int = 128, **kwargs) -> TextStream:
        """Like `generate`, but iterate over the returned stream to get text as it is accepted."""
        return TextStream(self._run(prompt, max_new_tokens, **kwargs))

    def _run(
        self,
        prompt,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | None = None,
        eos: bool = True,
        chat: bool | None = None,
        seed: int | None = 0,
        typical: bool = False,
    ):
        """The decoding loop: `_start` (checks, prefill), then one `_step` per target forward
        until the length, EOS or a stop string, then `_finish` (the result)."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, typical=typical)
        self._hold()
        try:
            run = self._start(prompt, max_new_tokens, params, stop, eos, chat, seed)
            try:
                while run.remaining > 0:
                    new = self._step(run)
                    yield new, run.shown[-1]
                    if run.finish != "length":
                        break
            except BaseException:  # closed or failed early: what it learned is kept anyway
                self.save_state()
                raise
            finally:
                if run.drafter is not None:
                    self._safe(run.stats, run.drafter.end)
                    run.stats.drafter_errors += run.drafter.failures - run.failures_before
            return self._finish(run)
        finally:
            self._holder = None
            self._busy.release()

    def _hold(self) -> None:
        """Take the Generator for one generation: wait while another thread runs one."""
        if self._holder == threading.get_ident():
            raise GenerationError(
                "this thread is already running a generation on this Generator (an "
                "unfinished stream or iter_steps): finish or close it first")
        self._busy.acquire()
        self._holder = threading.get_ident()

    # -- the stages of one generation ---------------------------------------------------

    def _start(self, prompt, max_new_tokens: int, params: SamplingParams,
               stop: Sequence[str] | None, eos: bool, chat: bool | None,
               seed: int | None) -> _Run:
        """Check the request, prefill the prompt, start the drafter."""
        try:
            params.validate()
        except ValueError as exc:
            raise GenerationError(str(exc)) from None
        if max_new_tokens is None or int(max_new_tokens) <= 0:
            raise GenerationError(f"max_new_tokens must be positive, got {max_new_tokens}")
        ids = self.encode(prompt, chat)
        if len(ids) >= self.context_limit:
            raise GenerationError(
                f"prompt is {len(ids)} tokens; the model's context is {self.context_limit}"
            )
        drafter = self.drafter
        run = _Run(
            ids=ids,
            max_new=min(int(max_new_tokens), self.context_limit - len(ids)),
            params=params,
            sampler=torch.Generator().manual_seed(check_seed(seed)),
            eos_ids=self.eos_ids if eos else set(),
            stats=GenerationStats(prompt_tokens=len(ids)),
            drafter=drafter,
            cost=self.cost if drafter is not None else None,
            text=IncrementalText(self.tokenizer),
            stops=StopStrings([stop] if isinstance(stop, str) else stop or []),
            context=list(ids),
            packed_before=self.verifier.packed_forwards,
        )
        t0 = time.perf_counter()
        run.root = prefill(self.verifier, ids)
        _sync(self.verifier.device)
        run.stats.prefill_seconds = time.perf_counter() - t0
        run.started = time.perf_counter()
        if drafter is not None:
            run.failures_before = drafter.failures
            run.drafting = self._safe(run.stats, drafter.begin, run.context)
        return run

    def _step(self, run: _Run) -> list[int]:
        """One target forward: draft, choose the tree, verify it, accept, inform the drafter;
        returns the new tokens."""
        step_start = time.perf_counter()
        raw, side = self._draft(run)
        raw, tree = self._choose(run, raw, side)
        acc = self._verify(run, tree, side)
        new = self._accept(run, acc, raw, tree)
        self._inform_drafter(run, acc, new)
        if run.cost is not None:
            run.cost.observe(len(tree) + len(side) + 1, self.verifier.last_forward_cost)
            self._learn_overhead(run.cost, time.perf_counter() - step_start,
                                 self.verifier.last_forward_seconds)
        return new

    def _draft(self, run: _Run) -> tuple[Tree, Tree]:
        """The drafter's tree and side rows for this step, within the budget and checked; a
        drafter that fails is dropped for the rest of the generation."""
        raw = side = Tree()
        remaining = run.remaining
        budget = 0
        if run.drafting and remaining > 1:
            budget = run.cost.max_nodes
            if self.max_nodes is not None:
                budget = min(budget, self.max_nodes)
        if budget <= 0:
            return raw, side
        drafter, stats = run.drafter, run.stats
        t0 = time.perf_counter()
        try:
            vocab = int(self.model.config.vocab_size)
            side = drafter.side_rows(run.context)
            side.validate(vocab)
            if len(side) > budget:  # a forward capped below the drafter's rows
                side = Tree()
            raw = drafter.propose(run.context, budget - len(side))
            raw.validate(vocab)
        except Exception as exc:  # drafts are optional: never fail a generation
            self._drafter_failed(stats, exc)
            run.drafting, raw, side = False, Tree(), Tree()
        stats.draft_seconds += time.perf_counter() - t0
        return raw.limit_depth(min(self.max_depth, remaining - 1)), side

    def _choose(self, run: _Run, raw: Tree, side: Tree) -> tuple[Tree, Tree]:
        """The nodes worth verifying: (raw, calibrated) sub-trees the cost curve picks."""
        if not len(raw):
            return raw, raw
        calibrated = self.calibrator.apply(raw)
        keep = run.cost.select(calibrated, self.max_nodes, self.step_overhead, len(side))
        return raw.subset(keep), calibrated.subset(keep)

    def _verify(self, run: _Run, tree: Tree, side: Tree) -> Acceptance:
        """The forward over root + tree (+ side rows), acceptance, and the drafter's hooks on
        what the forward computed."""
        drafter, stats = run.drafter, run.stats
        want = drafter.candidates_wanted if run.drafting else 0
        want_hidden = run.drafting and drafter.hidden_wanted
        acc = speculative_decode(self.verifier, run.root, tree, run.params, run.sampler, want,
                                 want_hidden, side)
        stats.forward_seconds += self.verifier.last_forward_seconds
        t0 = time.perf_counter()
        if acc.candidates is not None:
            run.drafting = self._safe(stats, drafter.observe, run.context, tree,
                                      *acc.candidates)
        if run.drafting and acc.side is not None:
            run.drafting = self._safe(stats, drafter.observe_side, *acc.side)
        stats.draft_seconds += time.perf_counter() - t0
        stats.steps += 1
        return acc

    def _accept(self, run: _Run, acc: Acceptance, raw: Tree, tree: Tree) -> list[int]:
        """The step's new tokens (cut at EOS), counted per source, added to the context and
        the text."""
        stats = run.stats
        new = acc.tokens[: run.remaining]
        for i, t in enumerate(new):
            if t in run.eos_ids:
                new, run.finish = new[: i + 1], "eos"
                break
        if len(tree):
            stats.drafted += len(tree)
            self.calibrator.observe(raw, tree, acc)
            for node in acc.nodes[: len(new)]:  # drafts past an EOS are not output
                src = tree.sources[node]
                stats.accepted[src] = stats.accepted.get(src, 0) + 1
            reached = {-1, *acc.nodes}
            for parent, src in zip(tree.parents, tree.sources):
                if parent in reached:
                    stats.tried[src] = stats.tried.get(src, 0) + 1
        run.out.extend(new)
        run.context.extend(new)
        run.root = new[-1]
        run.shown.append(run.stops.feed(run.text.push(new)))
        if run.stops.stopped:
            run.finish = "stop"
        return new

    def _inform_drafter(self, run: _Run, acc: Acceptance, new: list[int]) -> None:
        """The accepted tokens, and the hidden state for the next step, to the drafter."""
        if not run.drafting:
            return
        drafter, stats = run.drafter, run.stats
        t0 = time.perf_counter()
        # the last step's tokens too: drafters that learn keep them
        run.drafting = self._safe(stats, drafter.update, new)
        if run.drafting and run.finish == "length" and run.remaining > 0:
            if acc.hidden is not None and len(new) == len(acc.tokens):
                run.drafting = self._safe(stats, drafter.observe_hidden, run.context,
                                          acc.hidden)
        stats.draft_seconds += time.perf_counter() - t0

    def _finish(self, run: _Run) -> GenerationResult:
        """Time and counters, what was learned saved, the text flushed."""
        stats = run.stats
        _sync(self.verifier.device)
        stats.seconds = time.perf_counter() - run.started
        stats.new_tokens = len(run.out)
        stats.packed_forwards = self.verifier.packed_forwards - run.packed_before
        self.save_state()
        if run.cost is not None:
            run.cost.save()  # what the timed forwards corrected, for the next process
        run.shown.append(run.stops.feed(run.text.flush()))
        if run.stops.stopped:
            run.finish = "stop"
        run.shown.append(run.stops.flush())
        return GenerationResult(run.out, "".join(run.shown), stats, run.finish, run.ids)

    def _learn_overhead(self, cost: CostModel, step_seconds: float, forward_seconds: float
                        ) -> None:
        """Move the overhead estimate toward this step's time outside the target's forward.

        Clipped to one plain forward so that a burst of load on a shared machine cannot
        inflate it much; the running average forgets within a few dozen steps.
        """
        sample = min(max(step_seconds - forward_seconds, 0.0), cost.cost(1))
        self.step_overhead += 0.05 * (sample - self.step_overhead)

    def _safe(self, stats: GenerationStats, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as exc:  # drafts are optional: see _drafter_failed
            self._drafter_failed(stats, exc)
            return False

    @staticmethod
    def _drafter_failed(stats: GenerationStats, exc: Exception) -> None:
        stats.drafter_errors += 1
        log.warning("drafter failed (%s); continuing without drafts", exc)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _context_limit(model) -> int:
    cfg = model.config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 30


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for value in (getattr(gen_cfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
