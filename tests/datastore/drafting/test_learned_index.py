"""The learned index: drafts from earlier outputs, tenants kept apart, bounded memory."""

from __future__ import annotations

import random

from redraft.datastore.drafting.learned_index import KEEP, LEVELS, PROMPT_TAIL, LearnedIndex
from redraft.proto.tree import LEARNED


def paths(draft) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for t, p in zip(draft.tokens, draft.parents):
        out.append((out[p] if p >= 0 else ()) + (t,))
    return out


def occurs(seq, pattern) -> bool:
    n = len(pattern)
    return any(seq[i:i + n] == list(pattern) for i in range(len(seq) - n + 1))


def record(index, tenant, prompt, output, close=True):
    w = index.writer(tenant, prompt)
    for i in range(0, len(output), 3):
        w.extend(output[i:i + 3])
    if close:
        w.close()
    return w


def test_a_second_answer_to_the_same_prompt_is_drafted_from_the_first():
    index = LearnedIndex()
    prompt = list(range(100, 140))
    answer = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    record(index, "", prompt, answer)
    d = index.propose("", prompt, budget=16, max_depth=8)
    d.validate()
    assert paths(d)[:8] == [tuple(answer[:k]) for k in range(1, 9)]
    assert set(d.sources) == {LEARNED}
    assert d.match_len == PROMPT_TAIL  # the stored prompt tail matched as a whole
    mid = index.propose("", prompt + answer[:4], budget=16, max_depth=16)
    assert mid.tokens[:6] == answer[4:]


class ListJournal:
    """A journal that keeps what it is told: (event, output, tenant or tokens)."""

    def __init__(self):
        self.events = []

    def begin(self, tenant):
        self.events.append(("begin", len(self.events), tenant))
        return len(self.events) - 1

    def append(self, output, tokens):
        self.events.append(("append", output, list(tokens)))

    def end(self, output):
        self.events.append(("end", output, None))


def test_an_ongoing_output_counts_as_soon_as_it_is_accepted_and_is_journaled_as_written():
    journal = ListJournal()
    index = LearnedIndex(journal=journal)
    w = record(index, "t", [1, 2, 3], [4, 5, 6, 7, 8, 9], close=False)
    assert index.propose("t", [50, 4, 5, 6], budget=8, max_depth=8).tokens[:3] == [7, 8, 9]
    assert journal.events == [("begin", 0, "t"), ("append", 0, [1, 2, 3, 4, 5, 6]),
                              ("append", 0, [7, 8, 9])]  # the prompt tail comes first
    w.close()
    assert journal.events[-1] == ("end", 0, None)
    index.writer("t", [1]).close()  # nothing accepted: nothing journaled
    replayed = index.writer("t", [], journal=False)  # an output learned elsewhere
    replayed.extend([1, 2, 3])
    replayed.close()
    assert len(journal.events) == 4


def test_empty_pools_are_dropped_so_memory_is_bounded_in_tenants_too():
    index = LearnedIndex(max_tokens=1000)
    for t in range(5000):
        record(index, f"tenant-{t}", [1, 2], [t % 900 + 3, 7, 8, 9])
    stats = index.stats()
    assert stats["learned_tokens"] <= 1000
    assert stats["learned_pools"] == stats["learned_docs"] <= 1000 // 6 + 1
    assert len(index._pool_docs) == stats["learned_pools"]
    # a writer whose document was evicted goes on in a fresh pool
    w = index.writer("again", [1, 2])
    w.extend([3, 4])
    for t in range(300):
        record(index, f"other-{t}", [1, 2], [5, 6, 7, 8])
    w.extend([5, 6, 7])
    w.close()
    assert index.propose("again", [3, 4, 5], 4, 4).tokens == [6, 7]


def test_every_drafted_path_continues_a_real_match_of_the_same_tenant():
    rng = random.Random(1)
    phrases = [[rng.randrange(1, 60) for _ in range(rng.randrange(2, 6))] for _ in range(12)]
    index = LearnedIndex()
    outputs = {"a": [], "b": []}
    for tenant in ("a", "b") * 10:
        prompt = [rng.randrange(60, 90) for _ in range(5)]
        out = sum((rng.choice(phrases) for _ in range(10)), [])
        record(index, tenant, prompt, out)
        outputs[tenant].append(prompt[-PROMPT_TAIL:] + out)
    checked = 0
    for _ in range(300):
        tenant = rng.choice("ab")
        ctx = [rng.randrange(60, 90)] + sum((rng.choice(phrases) for _ in range(2)), [])
        d = index.propose(tenant, ctx, budget=32, max_depth=6)
        d.validate()
        for path in paths(d):  # a matched suffix then the path, inside one of its outputs
            assert any(occurs(doc, ctx[-LEVELS[-1]:] + list(path)) for doc in outputs[tenant])
            checked += 1
    assert checked > 300


def test_tenants_never_receive_each_others_text_unless_shared():
    rng = random.Random(2)
    secret = [rng.randrange(1000, 2000) for _ in range(50)]
    for shared in (False, True):
        index = LearnedIndex(shared=shared)
        record(index, "alice", [1, 2, 3], secret)
        hits_bob = sum(len(index.propose("bob", secret[:i], 32, 16)) for i in range(2, 40))
        hits_alice = sum(len(index.propose("alice", secret[:i], 32, 16)) for i in range(2, 40))
        assert hits_alice > 0
        assert (hits_bob > 0) == shared


def test_memory_is_bounded_oldest_evicted_first_index_entries_with_them():
    rng = random.Random(3)
    index = LearnedIndex(max_tokens=2000)
    outputs = []
    for s in range(60):
        out = [rng.randrange(1, 5000) for _ in range(rng.randrange(50, 150))]
        record(index, "", [9000 + s], out)
        outputs.append(out)
        assert index.n_tokens <= 2000
    # an n-gram's entries: one int, or a list once it repeats
    counts = [1 if isinstance(v, int) else len(v) for pool in index._pools.values()
              for v in pool.values()]
    assert sum(counts) <= len(LEVELS) * index.n_tokens  # nothing left behind by evicted outputs
    assert max(counts) <= KEEP
    assert len(index.propose("", outputs[-1][:10], 8, 8)) > 0  # the newest is drafted
    assert len(index.propose("", outputs[0][:10], 8, 8)) == 0  # the oldest is gone
    for s in range(10):  # one output longer than the bound keeps only its recent part
        record(index, "", [1], list(range(3000 + s, 9000, 2)))
        assert index.n_tokens <= 2000


def test_load_keeps_the_bound_and_journals_nothing():
    journal = ListJournal()
    index = LearnedIndex(max_tokens=100, journal=journal)
    index.load([("t", list(range(i * 60, i * 60 + 60))) for i in range(5)])
    assert index.n_tokens == 60 and index.stats()["learned_docs"] == 1
    assert journal.events == []
    assert index.propose("t", [240, 241, 242], 4, 4).tokens == [243, 244, 245, 246]
