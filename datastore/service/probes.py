"""`redraft serve --metrics-port`: HTTP probes and Prometheus metrics on one port.

Why HTTP beside gRPC health: Kubernetes probes, load balancers and Prometheus speak HTTP.
`/healthz` answers 200 while the process runs; `/readyz` 200 once a worker listens with the
datastore open and the server is not shutting down, else 503; `/metrics` is Prometheus text
(prometheus-client's own exposition) of the whole server: it reads the counters the workers
share (`stats.ServiceStats` and its `metrics.MetricSlots`), so `--workers N` needs no
multiprocess directory and nothing is counted twice. It runs on a thread of the process
that holds those counters: the parent of `--workers N`, or the server itself.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from redraft.datastore.service.config import ServiceConfig
from redraft.datastore.service.metrics import (
    CORPUS_SLOTS,
    COUNTERS,
    ENTRY_BUCKETS,
    N_BITS,
    POSITIONS,
    SOURCE_NAMES,
    TIME_BUCKETS,
)
from redraft.datastore.service.stats import ServiceStats
from redraft.datastore.service.tenants import token_key
from redraft.proto.errors import RedraftError

PREFIX = "redraft:"
_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
_COUNTER_HELP = {
    "persist_failures": "Persists of learned outputs that failed (retried by the next one)",
    "quarantined_records": "Learned-output log records set aside, neither persisted nor "
                           "drafted",
    "reloads": "New datastore commits opened and served without a restart",
    "reload_failures": "New datastore commits that could not be served (kept the old one)",
    "share_failures": "Syncs of learned outputs with the other processes that failed",
}


def tenant_labels(config: ServiceConfig, slots: int) -> list[str]:
    """The `tenant` label of each tenant slot: a token's key as learned outputs are kept
    under it, cut to 16 hex digits (`k:1f0c...`; never the token), or, without auth, the
    slot declared tenants hash into (`slot-7`)."""
    tokens = config.tokens()
    if tokens:
        return [token_key(t)[:18] for t in tokens][:slots]
    return [f"slot-{i}" for i in range(slots)]


class ServiceCollector(Collector):
    """Prometheus families read from the shared counters at each scrape."""

    def __init__(self, stats: ServiceStats, config: ServiceConfig) -> None:
        self.stats = stats
        self.labels = tenant_labels(config, stats.tenants)

    def collect(self) -> Iterator[Metric]:
        m = self.stats.metrics.read()
        stats = self.stats
        tenants = self.labels
        corpora = m["corpora"]

        def key_labels(key: int) -> list[str]:  # MetricSlots.key: tenant slot, corpus slot
            return [tenants[key // CORPUS_SLOTS], corpora[key % CORPUS_SLOTS]
                    or f"corpus-{key % CORPUS_SLOTS}"]

        drafts = CounterMetricFamily(
            PREFIX + "spec_decode_num_drafts", "Replies that carried a draft tree of at least "
            "one node (Session opens and steps, Batch entries and packed steps)",
            labels=["tenant", "corpus"])
        for key, n in enumerate(m["drafts"]):
            if n:
                drafts.add_metric(key_labels(key), n)
        yield drafts
        for name, block, what in (
                ("spec_decode_num_draft_tokens", "draft_tokens", "Draft tokens (tree nodes) "
                 "sent, by the sources that proposed each"),
                ("spec_decode_num_accepted_tokens", "accepted", "Draft tokens accepted: the "
                 "nodes the tokens a client reported back followed, by their sources")):
            family = CounterMetricFamily(PREFIX + name, what,
                                         labels=["tenant", "corpus", "source"])
            for i, n in enumerate(m[block]):
                if n:
                    family.add_metric([*key_labels(i // N_BITS), SOURCE_NAMES[i % N_BITS]], n)
            yield family
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by "
            f"their depth in the tree (0: a root's child; the first {POSITIONS})",
            labels=["position"])
        for p, n in enumerate(m["positions"]):
            per_pos.add_metric([str(p)], n)
        yield per_pos
        yield _histogram("session_step_seconds", "Server time of a Session step: from its "
                         "request read to its reply ready", TIME_BUCKETS, m["step_hist"])
        yield _histogram("batch_call_seconds", "Server time of a Batch call", TIME_BUCKETS,
                         m["batch_hist"])
        yield _histogram("batch_call_entries", "Entries plus packed steps per Batch call",
                         ENTRY_BUCKETS, m["entries_hist"])
        refusals = CounterMetricFamily(
            PREFIX + "refusals", "Calls and Batch entries refused, by gRPC status",
            labels=["code"])
        for code, n in enumerate(m["refusals"]):
            if n:
                refusals.add_metric([_CODE_NAMES.get(code, str(code))], n)
        yield refusals
        for name in COUNTERS:
            yield CounterMetricFamily(PREFIX + name, _COUNTER_HELP[name],
                                      value=m["counters"][name])
        yield CounterMetricFamily(PREFIX + "worker_restarts", "Worker processes that died "
                                  "and were replaced", value=stats.get("worker_restarts"))
        yield CounterMetricFamily(PREFIX + "requests", "Drafting requests answered "
                                  "(session opens and steps, Propose calls, batched "
                                  "sequence-steps)", value=stats.get("requests"))
        yield GaugeMetricFamily(PREFIX + "sessions_open", "Sessions and sequences open now, "
                                "all workers", value=stats.get("sessions_active"))
        by_tenant = GaugeMetricFamily(PREFIX + "tenant_sessions_open", "Sessions and "
                                      "sequences open now, by tenant", labels=["tenant"])
        for t, n in enumerate(stats.open_by_tenant()):
            if n:
                by_tenant.add_metric([tenants[t]], n)
        yield by_tenant
        learned = [w["learned_tokens"] for w in stats.per_worker()]
        yield GaugeMetricFamily(PREFIX + "learned_tokens", "Tokens of learned outputs held "
                                "in memory (the largest worker's index: each holds every "
                                "output once synced)", value=max(learned, default=0))
        workers = [w for w in m["workers"] if w["ready"] or w["datastore_tokens"]]
        yield GaugeMetricFamily(PREFIX + "workers_ready", "Worker processes listening with "
                                "the datastore open", value=sum(w["ready"] for w in workers))
        for name, key, what in (("datastore_tokens", "datastore_tokens", "Tokens of the "
                                 "datastore snapshot served"),
                                ("datastore_segments", "datastore_segments", "Segments of "
                                 "the datastore snapshot served"),
                                ("datastore_commit", "commit", "Generation of the datastore "
                                 "commit served (the newest any worker serves)")):
            yield GaugeMetricFamily(PREFIX + name, what,
                                    value=max((w[key] for w in workers), default=0))
        persisted = max((w["last_persist_unix"] for w in m["workers"]), default=0)
        if persisted:
            yield GaugeMetricFamily(PREFIX + "seconds_since_last_persist", "Seconds since "
                                    "the last successful persist of learned outputs",
                                    value=max(0.0, time.time() - persisted))


def _histogram(name: str, what: str, bounds, raw: list[float]) -> HistogramMetricFamily:
    """A histogram from its shared buckets (per bucket, then +Inf, then the sum)."""
    cumulative, total = [], 0.0
    for bound, n in zip([*map(str, bounds), "+Inf"], raw[:len(bounds) + 1]):
        total += n
        cumulative.append((bound, total))
    return HistogramMetricFamily(PREFIX + name, what, buckets=cumulative,
                                 sum_value=raw[len(bounds) + 1])


class ProbeServer:
    """The HTTP port: /healthz, /readyz and /metrics, on a daemon thread."""

    def __init__(self, host: str, port: int, stats: ServiceStats,
                 config: ServiceConfig) -> None:
        self.stats = stats
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ServiceCollector(stats, config))
        probes = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self._send(200, b"ok\n")
                elif path == "/readyz":
                    ready = probes.stats.metrics.ready()
                    self._send(200 if ready else 503, b"ready\n" if ready else b"not ready\n")
                elif path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                else:
                    self._send(404, b"not found: /healthz, /readyz or /metrics\n")

            def _send(self, code: int, body: bytes,
                      kind: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes every few seconds: no log line
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True  # a scrape in flight never holds the process up
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        try:
            self.httpd = Server((host, port), Handler)
        except OSError as exc:
            raise RedraftError(f"--metrics-port {port}: cannot listen on {host}:{port}: "
                               f"{exc.strerror or exc}") from None
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="redraft-probes")

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
