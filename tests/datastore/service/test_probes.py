"""`redraft serve --metrics-port`: /metrics scraped with prometheus_client's own parser
while two workers serve Session steps and Batch calls under two tokens, against what the
clients saw, and by the corpora sessions and sequences restrict retrieval to; /readyz 503
before the workers listen and once shutting down, 200 between (real servers on real
ports)."""

from __future__ import annotations

import hashlib
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redraft.datastore import append_corpus, build_datastore
from redraft.datastore.service.client import (
    AuthenticationFailed,
    DraftClient,
    DraftParams,
    InvalidRequest,
    SequenceOpen,
    SequenceStep,
)
from redraft.datastore.service.spawn import ServeProcess

FP = "sha256:probes"
DOCS = [[(11 * i + 3 * j) % 450 + 1 for j in range(120)] for i in range(12)]
TOKENS = ("alpha-raw-secret-7f3", "beta-raw-secret-9c1")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("probes") / "ds")
    build_datastore(None, path, documents=DOCS, fingerprint=FP, vocab_size=500)
    return path


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(url: str) -> tuple[str, dict[tuple, float]]:
    """/metrics as text and as {(sample name, sorted labels): value}, by prometheus_client's
    parser."""
    status, text = get(url + "/metrics")
    assert status == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return text, samples


def tenant(token: str) -> str:
    """The label of a token's tenant: its key's first 16 hex digits."""
    return "k:" + hashlib.sha256(f"Bearer {token}".encode()).hexdigest()[:16]


class Seen:
    """What the clients saw, counted as /metrics should count it: replies with a tree, their
    nodes by source, and the nodes each step's accepted tokens follow in the tree before."""

    def __init__(self) -> None:
        self.drafts: Counter = Counter()
        self.tokens: Counter = Counter()
        self.accepted: Counter = Counter()
        self.positions: Counter = Counter()

    def reply(self, who: str, tree) -> None:
        if len(tree):
            self.drafts[who] += 1
        for label in tree.sources:
            self.tokens[who, label] += 1

    def step(self, who: str, before, accepted) -> None:
        cur = -1
        for depth, token in enumerate(accepted):
            nxt = [i for i in range(len(before)) if before.parents[i] == cur
                   and before.tokens[i] == token]
            if not nxt:
                return
            cur = nxt[0]
            self.accepted[who, before.sources[cur]] += 1
            self.positions[depth] += 1


def test_metrics_of_two_workers_and_two_tokens_match_what_clients_saw(store, servers,
                                                                      tmp_path, until):
    tokens = tmp_path / "tokens"
    tokens.write_text("\n".join(TOKENS) + "\n")
    serve = servers.start(store, "--port", str(servers.free_port()), "--workers", "2",
                          "--token-file", str(tokens), "--metrics-port", "0",
                          "--learn-persist-seconds", "0")
    url = serve.metrics_url
    seen = Seen()
    steps = batch_calls = entries = 0
    clients: list[DraftClient] = []
    held = []
    try:
        # connections until both workers serve some client of each token
        pids: dict[str, set[int]] = {t: set() for t in TOKENS}
        mine: list[tuple[str, DraftClient]] = []
        while min(map(len, pids.values())) < 2 and len(clients) < 40:
            for t in TOKENS:
                c = DraftClient(serve.address, token=t, own_connection=True, reconnect=False)
                clients.append(c)
                pid = c.stats()["pid"]
                if pid not in pids[t]:
                    pids[t].add(pid)
                    mine.append((t, c))
        assert all(len(p) == 2 for p in pids.values())
        params = DraftParams(budget=16, max_depth=8)
        for n, (token, c) in enumerate(mine):
            who = tenant(token)
            doc = DOCS[n]
            with c.session(doc[:20], params, FP) as s:  # Session steps
                before = s.draft
                seen.reply(who, before)
                pos = 20
                for k in (1, 3, 2, 4, 1, 2):
                    tree = s.step(doc[pos:pos + k])
                    seen.step(who, before, doc[pos:pos + k])
                    seen.reply(who, tree)
                    before, pos, steps = tree, pos + k, steps + 1
            # Batch calls of two sequences: their opens, then packed steps
            docs = (DOCS[n + 6], DOCS[(n + 9) % len(DOCS)])
            r = c.batch([SequenceOpen(f"s{j}", d[:20]) for j, d in enumerate(docs)], params,
                        FP)
            befores, pos = [r.tree(0), r.tree(1)], 20
            for tree in befores:
                seen.reply(who, tree)
            batch_calls, entries = batch_calls + 1, entries + 2
            for k in (2, 1, 3, 4):
                steps_ = [d[pos:pos + k] for d in docs]
                r = c.batch([SequenceStep(f"s{j}", a) for j, a in enumerate(steps_)], params,
                            FP)
                for j, a in enumerate(steps_):
                    seen.step(who, befores[j], a)
                    befores[j] = r.tree(j)
                    seen.reply(who, befores[j])
                pos += k
                batch_calls, entries = batch_calls + 1, entries + 2
            r = c.batch([SequenceStep("never-opened", [1])], params, FP)  # NOT_FOUND, alone
            assert r.errors[0] is not None
            batch_calls, entries = batch_calls + 1, entries + 1
        with pytest.raises(AuthenticationFailed):
            DraftClient(serve.address, token="wrong-token", reconnect=False).info()
        with mine[0][1].session(DOCS[0][:20], params, FP) as s:
            seen.reply(tenant(mine[0][0]), s.draft)
            with pytest.raises(InvalidRequest):
                s.step([10**6])
        for token, c in mine[:2]:  # one open session per token at the scrape
            held.append(c.session(DOCS[1][:20], params, FP).__enter__())
            seen.reply(tenant(token), held[-1].draft)

        def published(m: dict) -> bool:  # each worker copies its counts every 0.1 s
            return (m.get(("redraft:session_step_seconds_count", ())) == steps
                    and m.get(("redraft:batch_call_seconds_count", ())) == batch_calls
                    and sum(v for (name, _), v in m.items()
                            if name == "redraft:refusals_total") == len(mine) + 2
                    and all(m.get(("redraft:spec_decode_num_drafts_total",
                                   (("corpus", "all"), ("tenant", who)))) == seen.drafts[who]
                            for who in map(tenant, TOKENS)))

        until(lambda: published(scrape(url)[1]), timeout=10)
        text, m = scrape(url)
        assert not any(t in text for t in TOKENS)  # the raw tokens never appear
        for who in map(tenant, TOKENS):
            assert m["redraft:spec_decode_num_drafts_total",
                     (("corpus", "all"), ("tenant", who))] == seen.drafts[who] > 0
        got = {(dict(k)["tenant"], dict(k)["source"]): v for (name, k), v in m.items()
               if name == "redraft:spec_decode_num_draft_tokens_total"}
        assert got == dict(seen.tokens)
        got = {(dict(k)["tenant"], dict(k)["source"]): v for (name, k), v in m.items()
               if name == "redraft:spec_decode_num_accepted_tokens_total"}
        assert got == dict(seen.accepted) and sum(got.values()) > 0
        for depth in range(16):
            assert m["redraft:spec_decode_num_accepted_tokens_per_pos_total",
                     (("position", str(depth)),)] == seen.positions[depth]
        assert m["redraft:session_step_seconds_count", ()] == steps
        assert 0 < m["redraft:session_step_seconds_sum", ()] < steps
        assert m["redraft:batch_call_seconds_count", ()] == batch_calls
        assert m["redraft:batch_call_entries_sum", ()] == entries
        assert m["redraft:refusals_total", (("code", "UNAUTHENTICATED"),)] == 1
        assert m["redraft:refusals_total", (("code", "INVALID_ARGUMENT"),)] == 1
        assert m["redraft:refusals_total", (("code", "NOT_FOUND"),)] == len(mine)
        # the held sessions, and each client's two batched sequences (never closed)
        assert m["redraft:sessions_open", ()] == 2 + 2 * len(mine)
        for t in TOKENS:
            assert m["redraft:tenant_sessions_open", (("tenant", tenant(t)),)] == \
                1 + 2 * sum(token == t for token, _ in mine)
        assert m["redraft:workers_ready", ()] == 2
        assert m["redraft:datastore_tokens", ()] == sum(map(len, DOCS))
        assert m["redraft:datastore_segments", ()] == 1
        assert m["redraft:learned_tokens", ()] > 0
        assert m["redraft:reloads_total", ()] == 0
        assert m["redraft:persist_failures_total", ()] == 0
    finally:
        for s in held:
            s.close()
        for c in clients:
            c.close()
    assert serve.stop() == 0


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("probes") / "two")
    build_datastore(None, path, documents=DOCS[:6], fingerprint=FP, vocab_size=500,
                    corpus="code")
    append_corpus(None, path, documents=DOCS[6:], fingerprint=FP, corpus="docs")
    return path


def test_draft_and_accepted_tokens_are_counted_by_the_corpora_asked_for(two_corpora,
                                                                        servers, until):
    """A Session restricted to one corpus, one unrestricted, and batched sequences restricted
    to both corpora or to none: each counted under its selection's `corpus` label."""
    serve = servers.start(two_corpora, "--port", str(servers.free_port()), "--workers", "2",
                          "--metrics-port", "0", "--learn-persist-seconds", "0")
    seen = Seen()
    steps = batch_calls = 0
    with DraftClient(serve.address, own_connection=True) as c:
        for n, corpora in enumerate([("docs",), (), ("docs",)]):
            label = "+".join(corpora) or "all"
            doc = DOCS[6 + n]
            params = DraftParams(budget=16, max_depth=8, corpora=corpora)
            with c.session(doc[:20], params, FP, tenant="t") as s:
                before, pos = s.draft, 20
                seen.reply(label, before)
                for k in (2, 3, 1, 4):
                    tree = s.step(doc[pos:pos + k])
                    seen.step(label, before, doc[pos:pos + k])
                    seen.reply(label, tree)
                    before, pos, steps = tree, pos + k, steps + 1
        docs = (DOCS[1], DOCS[8])
        selections = [("docs", "code"), ()]
        r = c.batch([SequenceOpen(f"s{j}", d[:20], DraftParams(budget=16, max_depth=8,
                                                                 corpora=sel))
                     for j, (d, sel) in enumerate(zip(docs, selections))], None, FP)
        labels = ["code+docs", "all"]
        befores, pos = [r.tree(0), r.tree(1)], 20
        for j, tree in enumerate(befores):
            seen.reply(labels[j], tree)
        batch_calls += 1
        for k in (3, 1, 2):
            accepted = [d[pos:pos + k] for d in docs]
            r = c.batch([SequenceStep(f"s{j}", a) for j, a in enumerate(accepted)], None, FP)
            for j, a in enumerate(accepted):
                seen.step(labels[j], befores[j], a)
                befores[j] = r.tree(j)
                seen.reply(labels[j], befores[j])
            pos, batch_calls = pos + k, batch_calls + 1

        def by_corpus(m: dict, name: str) -> dict:
            out: Counter = Counter()
            for (sample, k), v in m.items():
                if sample == name:
                    d = dict(k)
                    out[(d["corpus"], d["source"]) if "source" in d else d["corpus"]] += v
            return dict(out)

        def published(m: dict) -> bool:
            return (m.get(("redraft:session_step_seconds_count", ())) == steps
                    and m.get(("redraft:batch_call_seconds_count", ())) == batch_calls)

        until(lambda: published(scrape(serve.metrics_url)[1]), timeout=10)
        _, m = scrape(serve.metrics_url)
        assert by_corpus(m, "redraft:spec_decode_num_drafts_total") == dict(seen.drafts)
        assert set(seen.drafts) == {"docs", "all", "code+docs"}
        assert by_corpus(m, "redraft:spec_decode_num_draft_tokens_total") == dict(seen.tokens)
        got = by_corpus(m, "redraft:spec_decode_num_accepted_tokens_total")
        assert got == dict(seen.accepted)
        assert {corpus for corpus, _ in got} == {"docs", "all", "code+docs"}
    assert serve.stop() == 0


def test_readyz_is_503_until_the_workers_listen_and_once_shutting_down(store, servers):
    port = servers.free_port()
    base = f"http://127.0.0.1:{port}"
    started: list[ServeProcess] = []
    thread = threading.Thread(target=lambda: started.append(servers.start(
        store, "--port", str(servers.free_port()), "--workers", "2", "--metrics-port",
        str(port))))
    thread.start()
    answers = []
    try:
        deadline = time.monotonic() + 60
        while not started and time.monotonic() < deadline:
            try:
                answers.append(get(base + "/readyz")[0])
            except OSError:  # the probe port is not bound yet
                pass
            time.sleep(0.01)
    finally:
        thread.join(60)
    serve = started[0]
    assert 503 in answers  # before the workers listened
    assert answers == sorted(answers, reverse=True)  # then 200, never 503 again
    assert get(base + "/readyz") == (200, "ready\n")
    assert get(base + "/healthz") == (200, "ok\n")
    assert get(base + "/nothing")[0] == 404
    # Workers held stopped: the parent, which answers the probes, waits for them, so the
    # window between "not ready" and the exit is as long as the test needs (an idle
    # server's shutdown takes a few milliseconds).
    workers = [w for w in psutil.Process(serve.proc.pid).children()
               if "spawn_main" in " ".join(w.cmdline())]
    assert len(workers) == 2
    for w in workers:
        w.suspend()
    try:
        serve.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()  # the signal is handled a moment later: 503 from then on
        while (answer := get(base + "/readyz")) == (200, "ready\n"):
            assert time.monotonic() - t0 < 30  # generous: a loaded machine delays the handler
        assert answer == (503, "not ready\n")
        assert get(base + "/healthz") == (200, "ok\n")  # the process is still up
    finally:
        for w in workers:
            w.resume()
    assert serve.proc.wait(30) == 0
