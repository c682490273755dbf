"""When a chain of drafts pays, learned online from the engine's own forwards.

An engine that verifies a chain of L drafts runs a forward of 1 + L tokens and gains
1 + (accepted drafts) tokens. Whether that beats plain decoding depends on the machine: on a
GPU a forward of a few dozen tokens costs about one of a single token, while llama.cpp's
quantized CPU forward is compute-bound (a 2-token forward costs about twice a 1-token one),
so only near-certain drafts pay there. The adapter cannot read the hardware, but it sees the
time from handing out a chain to the next call, which is the forward of that chain (plus the
engine's per-token work), and how many of the drafts came back accepted. From those:

- cost: seconds per forward fitted as a + b * tokens by exponentially weighted least squares
  (recent forwards count most); until forwards of two sizes were seen, a flat cost is assumed,
  so drafting starts, and one plain forward follows the first drafted one to give the slope;
- calibration: the chance that a node is accepted given its parent was, per source and per
  bin of the drafter's own estimate, counted from the chains the target verified (the
  loop's `Calibrator`, from the shared policy module `redraft.decoder.policy`);
- choice: the chain prefix L that maximises expected tokens per second,
  (1 + sum of the prefix's path probabilities) / cost(1 + L), if it beats plain decoding by
  `min_gain` (10%); else no drafts (the loop's budget rule, `policy.best_prefix`);
- back-off: after `patience` calls in a row whose drafts did not pay (counting the drafter's
  own lookup time), drafting is skipped (the drafter is not even asked) for a number of
  calls that doubles on every idle round, so a machine where drafts never pay runs at plain
  speed; an accepted draft resets it.
"""

from __future__ import annotations

import itertools
import operator
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from redraft.decoder.policy import Calibrator, best_prefix


@dataclass
class CostFit:
    """Forward seconds as a + b * tokens, from timed forwards (recent ones weigh most)."""

    decay: float = 0.97
    last_tokens: int = 0  # size of the latest observed forward
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, wx, wxx, wy, wxy

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        s = self._s
        for i in range(5):
            s[i] *= self.decay
        self.last_tokens = tokens
        x, y = float(tokens), float(seconds)
        s[0] += 1.0
        s[1] += x
        s[2] += x * x
        s[3] += y
        s[4] += x * y

    @property
    def samples(self) -> float:
        return self._s[0]

    def slope(self) -> float | None:
        """Extra seconds per extra token; None until forwards of different sizes were seen."""
        w, wx, wxx, wy, wxy = self._s
        spread = w * wxx - wx * wx
        if w <= 0 or spread <= 1e-9 * w * w:
            return None
        return max(0.0, (w * wxy - wx * wy) / spread)

    def cost(self, tokens: int) -> float:
        """Seconds for a forward of `tokens` tokens (flat, 1.0, before any observation)."""
        w, wx, _, wy, _ = self._s
        if w <= 0:
            return 1.0
        b = self.slope() or 0.0
        a = (wy - b * wx) / w
        return max(a + b * tokens, 1e-9)


@dataclass
class BackOff:
    """Steps to skip after `patience` failures in a row: `first`, doubled on every such run up
    to `most`, until a success starts it over. Why doubling: a drafter that keeps losing
    costs ever less (plain speed in the limit), one that starts paying again is tried soon
    after its first misses."""

    patience: int = 8
    first: int = 16
    most: int = 1024
    failures: int = 0  # in a row
    skip: int = 0  # steps still to skip
    length: int = 0  # of the latest back-off

    def skipping(self) -> bool:
        """True (and one step fewer to wait) while backing off."""
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def failed(self) -> None:
        self.failures += 1
        if self.failures >= self.patience:
            self.failures = 0
            self.length = min(self.most, self.length * 2 or self.first)
            self.skip = self.length

    def passed(self) -> None:
        """Not a failure: the run of failures is broken, the next back-off as long."""
        self.failures = 0

    def succeeded(self) -> None:
        """A success: the next back-off is `first` again."""
        self.failures = self.length = 0


@dataclass
class ChainPacer:
    """Decides how many drafts of a chain to hand to the engine (0: none), and when to stop
    asking the drafter at all. `adaptive=False` always hands out the whole chain."""

    max_drafts: int = 16
    adaptive: bool = True
    # Drafts must promise this much more speed than plain decoding: the cost fit and the
    # calibration are estimates, and where a forward's cost grows with its tokens (a CPU)
    # a promised 3% is within their error (measured: llama.cpp on one core gained nothing
    # from chains the rule expected a few percent from).
    min_gain: float = 0.10
    patience: int = 8
    first_backoff: int = 16
    max_backoff: int = 1024
    cost: CostFit = field(default_factory=CostFit)
    calibration: Calibrator = field(default_factory=Calibrator)
    lookup_seconds: float = 0.0  # the drafter's own time per call (moving average)
    idle: BackOff = field(init=False)  # calls whose choice drafted nothing

    def __post_init__(self) -> None:
        self.idle = BackOff(self.patience, self.first_backoff, self.max_backoff)

    def wants_drafts(self) -> bool:
        """False while backing off: the caller skips drafting for this call."""
        return not self.adaptive or not self.idle.skipping()

    def choose(self, probs: Sequence[float], sources: Sequence[str]) -> int:
        """How many of the chain's first nodes to draft."""
        n = min(len(probs), self.max_drafts)
        if not self.adaptive or n == 0:
            return n
        if self.cost.slope() is None and self.cost.last_tokens > 1:
            return 0  # only drafted forwards timed so far: time a plain one to get a slope
        path_probs = itertools.accumulate(self.calibration.calibrated(probs[:n], sources[:n]),
                                          operator.mul)
        best, best_expected = best_prefix(path_probs, self.cost.cost, self.min_gain)
        # This call's lookup is paid already; whether drafting is worth going on with counts
        # it: a lookup that costs more than its drafts gain is no better than none.
        plain = self.cost.cost(1)
        worth = (1.0 + best_expected) / (self.cost.cost(1 + best) + self.lookup_seconds)
        if best and worth * plain >= 1.0 + self.min_gain:
            self.idle.passed()
        else:
            self.idle.failed()
        return best

    def drafted(self, seconds: float) -> None:
        """The drafter took `seconds` to propose this call's chain."""
        if seconds >= 0:
            self.lookup_seconds += 0.1 * (seconds - self.lookup_seconds)

    def forward(self, tokens: int, seconds: float) -> None:
        """A forward of `tokens` tokens took `seconds` (handing out drafts to the next call)."""
        self.cost.observe(tokens, seconds)

    def verified(self, probs: Sequence[float], sources: Sequence[str], accepted: int) -> None:
        """The drafts handed out last time came back with `accepted` of them accepted."""
        self.calibration.observe_chain(probs, sources, accepted)
        if accepted:
            self.idle.succeeded()


@dataclass
class RateGuard:
    """What drafted steps actually made against what plain steps would have made in the same
    seconds, judged every `patience` drafted steps (the median step): a loss turns drafting
    off for a number of steps that doubles on every loss in a row, then drafting is tried
    again.

    Why: the pacer's choice rests on a model (a line through step times, calibrated
    probabilities) and an engine can cost what no line through its step times says: in
    vLLM's CPU build, 16 rows with about 20 drafts took 150-170 ms where 10 drafts took 72
    ms and the plain step 52 ms, so drafts the model expected to pay lost. Each step's own
    numbers (its rows, the tokens it made, its seconds) show that whatever the cause.
    """

    patience: int = 8
    losses: BackOff = field(default_factory=lambda: BackOff(patience=1, first=16, most=256))
    # each drafted step's tokens over what plain steps would have made in its seconds; the
    # median of `patience` of them is judged, so one step that a busy machine stalled does
    # not turn drafting off
    gains: list[float] = field(default_factory=list)

    def observe(self, made: int, seconds: float, plain_rate: float) -> None:
        """A drafted step made `made` tokens in `seconds`; plain steps of its rows make
        `plain_rate` tokens a second."""
        self.gains.append(made / (seconds * plain_rate))
        if len(self.gains) < self.patience:
            return
        if statistics.median(self.gains) < 1.0:
            self.losses.failed()
        else:
            self.losses.succeeded()
        self.gains.clear()


@dataclass
class BatchPacer:
    """`ChainPacer` for an engine that verifies every row's chain in one forward (vLLM): how
    many drafts each row gets, so that the step as a whole gains the most tokens per second.

    A step of n rows handing out L_i drafts each runs a forward of n + sum L_i tokens and
    gains n + the drafts accepted. So the nodes of all rows' chains are taken best first (by
    calibrated path probability, which never rises along a chain, so each row gets a prefix
    of its chain) for as long as they raise the step's expected rate: `best_prefix` over
    them with the other n - 1 rows' tokens fixed in the forward and the probabilities scaled
    by 1/n (the rate divided by n, which changes no choice). The cost, calibration and
    `min_gain` are those of `ChainPacer`: seconds per forward fitted from the engine's own
    steps (time between calls against the tokens the step verified); until forwards of two
    sizes were seen, drafting alternates with plain steps to find the slope.

    Over the model, a guard on the rate reached (`RateGuard`, one per power of two of rows:
    what loses at 16 rows may pay at 2): drafted steps that made fewer tokens than plain
    steps of as many rows would have in the same time turn drafting off for a while. So that
    the plain steps it compares with stay current, a plain step is run after `stale_after`
    drafted steps in a row.

    Asking the drafter costs the step its time too (a service's round trip: 2-3 ms of a
    30-130 ms step in vLLM's CPU build), so while no step drafts, it is asked less often:
    after `idle.patience` steps in a row whose chains were all cut to nothing,
    `wants_drafts` says no for a number of steps that doubles on every such run (`idle`),
    as while the guard backs off or a plain step is due. The caller still sends such a
    step's tokens, without waiting for a reply: the draft service learns every sequence
    all the same.
    """

    adaptive: bool = True
    min_gain: float = 0.10
    cost: CostFit = field(default_factory=CostFit)  # every timed forward
    # Forwards with and without drafts apart, too: an engine may run another kernel as soon as
    # a row has drafts (vLLM's CPU backend: a step with drafts costs more than the line
    # through the plain ones says), a jump one line through both would hide.
    plain: CostFit = field(default_factory=CostFit)
    drafting: CostFit = field(default_factory=CostFit)
    calibration: Calibrator = field(default_factory=Calibrator)
    stale_after: int = 64
    guards: dict[int, RateGuard] = field(default_factory=dict)  # by rows.bit_length()
    idle: BackOff = field(default_factory=lambda: BackOff(patience=8, first=2, most=32))
    _last_drafted: bool = False  # the latest timed forward verified drafts
    _since_plain: int = 0  # drafted forwards timed since the latest plain one

    def wants_drafts(self, rows: int) -> bool:
        """False: this step of `rows` rows drafts nothing, and the drafter need not be
        asked (one step fewer to wait)."""
        if not self.adaptive:
            return True
        if self._since_plain >= self.stale_after:
            return False  # a plain step is due
        return not self.guard(rows).losses.skipping() and not self.idle.skipping()

    def choose(self, chains: Sequence[tuple[Sequence[float], Sequence[str]]],
               rows: int) -> list[int]:
        """How many of each chain's first nodes to draft; `chains` are (drafter's per-node
        probabilities, sources) of the rows that have drafts, `rows` the rows of the step's
        forward (with or without drafts)."""
        if not self.adaptive:
            return [len(probs) for probs, _ in chains]
        if self.cost.slope() is None and self.cost.samples > 0 and self._last_drafted:
            return [0] * len(chains)  # time a forward of another size to get a slope
        nodes: list[tuple[float, int]] = []
        for i, (probs, sources) in enumerate(chains):
            path = 1.0
            for p in self.calibration.calibrated(probs, sources):
                path *= p
                nodes.append((path, i))
        nodes.sort(key=lambda node: -node[0])  # stable: a row's nodes stay in chain order
        n = max(rows, 1)
        best, _ = best_prefix((p / n for p, _ in nodes), lambda t: self.step_cost(t, n),
                              self.min_gain, fixed=n - 1)
        keep = [0] * len(chains)
        for _, i in nodes[:best]:
            keep[i] += 1
        if best:
            self.idle.succeeded()
        else:
            self.idle.failed()
        return keep

    def step_cost(self, tokens: int, rows: int) -> float:
        """Seconds for a forward of `tokens` tokens over `rows` rows (more tokens than rows:
        with drafts): the fit of such forwards where it is known there, else the line
        through all of them."""
        fit = self.drafting if tokens > rows else self.plain
        if fit.slope() is not None or (fit.samples > 0 and fit.last_tokens == tokens):
            return fit.cost(tokens)
        return self.cost.cost(tokens)

    def guard(self, rows: int) -> RateGuard:
        """The guard of steps of `rows` rows (made when first needed)."""
        key = max(rows, 1).bit_length()
        guard = self.guards.get(key)
        if guard is None:
            guard = self.guards[key] = RateGuard()
        return guard

    def forward(self, tokens: int, seconds: float, drafted: bool, rows: int = 0,
                made: int = 0) -> None:
        """The step's forward of `tokens` tokens (`drafted`: some were drafts) took
        `seconds`; its `rows` rows made `made` tokens (0: not known, no guard)."""
        if drafted and rows and made and self.plain.samples > 0 and seconds > 0:
            self.guard(rows).observe(made, seconds, rows / self.step_cost(rows, rows))
        self.cost.observe(tokens, seconds)
        (self.drafting if drafted else self.plain).observe(tokens, seconds)
        self._last_drafted = drafted
        self._since_plain = self._since_plain + 1 if drafted else 0

    def verified(self, probs: Sequence[float], sources: Sequence[str], accepted: int) -> None:
        """A row's drafts handed out last step came back with `accepted` of them accepted."""
        self.calibration.observe_chain(probs, sources, accepted)
