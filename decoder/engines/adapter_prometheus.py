"""The engine adapters' counters (`adapter_counters`) in Prometheus, read at scrape time.

Nothing here runs on an engine step: a scrape (or a publish every PUBLISH_S seconds) reads
the adapters' plain counters. Three ways out, as the engine allows:

- `AdapterCollector`, a prometheus_client collector for any registry: llama-cpp-python has
  no metrics of its own, so its users register it in theirs.
- `serve_http(port, host)`: prometheus_client's own HTTP server in the engine's process
  (`REDRAFT_ADAPTER_METRICS_PORT`). Why: vLLM's `/metrics` is served by its API server
  process, while the proposer runs in the engine core (or a worker) process, whose default
  registry no route reads.
- `MultiprocessPublisher`: where the engine runs prometheus_client's multiprocess mode
  (`PROMETHEUS_MULTIPROC_DIR` set: SGLang with `--enable-metrics`, vLLM with
  `--api-server-count` above 1 or the variable set by the user), the counts are written as
  counters into that directory, in a file of this process's own, every PUBLISH_S seconds
  and at exit; the engine's own `/metrics` then serves them beside its own.

The names are the service's with `adapter_` added (`redraft:adapter_spec_decode_num_drafts`,
...), so that a query summing the service's counters never adds an adapter's to them; the
labels are `engine` and, where they apply, `source` and `position`, all bounded.
`expose(port, host)` starts what the environment asks for, once per process; it never
raises for a port it cannot bind (drafts never break the engine: one warning).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, start_http_server, values
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from redraft.decoder.engines.adapter_counters import ALL, AdapterCounters, totals

log = logging.getLogger("redraft.engines")

PREFIX = "redraft:adapter_"
PUBLISH_S = 1.0  # how often counts reach a multiprocess directory

# name, help, labels beyond `engine`
FAMILIES = (
    ("spec_decode_num_drafts", "Engine steps at which a sequence was handed at least one "
     "draft token by the adapter", ()),
    ("spec_decode_num_draft_tokens", "Draft tokens the adapter handed to the engine, by "
     "the sources that proposed each", ("source",)),
    ("spec_decode_num_accepted_tokens", "Draft tokens the engine accepted, by the sources "
     "that proposed each", ("source",)),
    ("spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by their position in "
     "the drafts handed out (0: the first)", ("position",)),
    ("steps", "Engine steps the adapter was called at", ()),
    ("skipped_steps", "Engine steps at which the adapter did not ask for drafts (its "
     "pacing backed off)", ()),
)


def samples(counters: Iterable[AdapterCounters]
            ) -> Iterator[tuple[str, tuple[str, ...], float]]:
    """(family name, label values with `engine` first, count) of every count of
    `counters`, added up by engine."""
    for engine, t in sorted(totals(counters).items()):
        yield "spec_decode_num_drafts", (engine,), t["drafts"]
        for family, key in (("spec_decode_num_draft_tokens", "draft_tokens"),
                            ("spec_decode_num_accepted_tokens", "accepted_tokens")):
            for src, n in sorted(t[key].items()):
                yield family, (engine, src), n
        for pos, n in enumerate(t["accepted_per_pos"]):
            yield "spec_decode_num_accepted_tokens_per_pos", (engine, str(pos)), n
        yield "steps", (engine,), t["steps"]
        yield "skipped_steps", (engine,), t["skipped_steps"]


class AdapterCollector(Collector):
    """The counters of `counters` (default: every adapter of this process) as Prometheus
    counters, read at each scrape."""

    def __init__(self, counters: Sequence[AdapterCounters] | None = None) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        families = {name: CounterMetricFamily(PREFIX + name, what, labels=("engine",) + extra)
                    for name, what, extra in FAMILIES}
        for name, labels, n in samples(ALL if self.counters is None else self.counters):
            families[name].add_metric(labels, n)
        yield from families.values()


def serve_http(port: int, host: str = "127.0.0.1",
               counters: Sequence[AdapterCounters] | None = None):
    """prometheus_client's HTTP server on `host:port` (0: any free port) serving `/metrics`
    of `counters` (default: every adapter of this process) from a registry of its own; the
    server (its `server_address` says the port; `shutdown()` stops it)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(AdapterCollector(counters))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server


class MultiprocessPublisher:
    """This process's adapters' counts, written into prometheus_client's multiprocess
    directory (`PROMETHEUS_MULTIPROC_DIR`, read when the first count is written) as
    counters, by `publish()`: each sample set to its running total, so a publish is
    idempotent. The file is this process's own (its pid and `redraft` name it), beside
    whatever prometheus_client objects of the engine write theirs."""

    def __init__(self, counters: Sequence[AdapterCounters] | None = None) -> None:
        self.counters = counters
        self._value_class = values.MultiProcessValue(lambda: f"{os.getpid()}-redraft")
        self._values: dict[tuple[str, tuple[str, ...]], object] = {}
        self._helps = {name: (what, ("engine",) + extra) for name, what, extra in FAMILIES}
        self._lock = threading.Lock()  # the publishing thread and exit
        self._stop = threading.Event()

    def publish(self) -> None:
        with self._lock:
            for name, labels, n in samples(ALL if self.counters is None else self.counters):
                value = self._values.get((name, labels))
                if value is None:
                    if not n:
                        continue  # a count never seen stays out of the file
                    what, labelnames = self._helps[name]
                    metric = PREFIX + name
                    value = self._values[(name, labels)] = self._value_class(
                        "counter", metric, metric + "_total", labelnames, labels, what)
                value.set(float(n))

    def start(self, interval: float | None = None) -> MultiprocessPublisher:
        """Publish every `interval` seconds (default PUBLISH_S) on a daemon thread, and once
        at exit."""
        interval = PUBLISH_S if interval is None else interval

        def run() -> None:
            while not self._stop.wait(interval):
                self._publish_logged()

        threading.Thread(target=run, name="redraft-adapter-metrics", daemon=True).start()
        atexit.register(self._publish_logged)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._publish_logged()

    def _publish_logged(self) -> None:
        try:
            self.publish()
        except Exception as exc:  # metrics never break the engine
            log.warning("redraft: publishing adapter metrics failed (%s: %s)",
                        type(exc).__name__, exc)


# What `expose` started in this process: one HTTP server per address, one publisher.
_servers: dict[tuple[str, int], object] = {}
_publisher: list[MultiprocessPublisher] = []
_expose_lock = threading.Lock()


def expose(port: int | None = None, host: str = "127.0.0.1") -> None:
    """Start, once per process, what the settings and environment ask for: the HTTP server
    when `port` is given, the publisher when `PROMETHEUS_MULTIPROC_DIR` names a directory.
    A port taken (another engine rank of this machine bound it first) is one warning."""
    with _expose_lock:
        if port is not None and (host, port) not in _servers:
            try:
                _servers[(host, port)] = serve_http(port, host)
                log.info("redraft: adapter metrics at http://%s:%d/metrics", host, port)
            except OSError as exc:
                _servers[(host, port)] = None  # not retried by every adapter made later
                log.warning("redraft: adapter metrics not served on %s:%d (%s)", host, port,
                            exc.strerror or exc)
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory and os.path.isdir(directory) and not _publisher:
            _publisher.append(MultiprocessPublisher().start())
