"""The adapters' counters in Prometheus: the collector read by prometheus_client's own parser,
the HTTP server an engine process can start, and the multiprocess publishing that puts them on
vLLM's and SGLang's own `/metrics` (real processes writing a real multiprocess directory,
read back by prometheus_client's MultiProcessCollector, as the engines' HTTP servers read it).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from redraft.decoder.engines.adapter_counters import AdapterCounters
from redraft.decoder.engines.adapter_prometheus import (
    PREFIX,
    AdapterCollector,
    expose,
    serve_http,
)
from redraft.decoder.engines.settings import EngineSettings
from redraft.decoder.engines.streams import EngineConfigError


def values(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of Prometheus text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def counted(engine: str = "vllm") -> AdapterCounters:
    c = AdapterCounters(engine)
    c.steps, c.skipped_steps = 5, 2
    c.drafted(["rest", "rest", "pld"])
    c.drafted(["learned"])
    c.accepted(["rest", "rest", "pld"], 2)
    return c


def test_the_collector_reports_every_counter_with_its_labels():
    registry = CollectorRegistry()
    registry.register(AdapterCollector([counted(), counted()]))
    got = values(generate_latest(registry).decode())
    e = (("engine", "vllm"),)
    assert got[(PREFIX + "spec_decode_num_drafts_total", e)] == 4
    assert got[(PREFIX + "spec_decode_num_draft_tokens_total",
                (("engine", "vllm"), ("source", "rest")))] == 4
    assert got[(PREFIX + "spec_decode_num_draft_tokens_total",
                (("engine", "vllm"), ("source", "learned")))] == 2
    assert got[(PREFIX + "spec_decode_num_accepted_tokens_total",
                (("engine", "vllm"), ("source", "rest")))] == 4
    assert (PREFIX + "spec_decode_num_accepted_tokens_total",
            (("engine", "vllm"), ("source", "pld"))) not in got  # never accepted
    per_pos = PREFIX + "spec_decode_num_accepted_tokens_per_pos_total"
    assert got[(per_pos, (("engine", "vllm"), ("position", "1")))] == 2
    assert got[(per_pos, (("engine", "vllm"), ("position", "2")))] == 0
    assert got[(PREFIX + "steps_total", e)] == 10
    assert got[(PREFIX + "skipped_steps_total", e)] == 4


def test_the_http_server_serves_the_counts_of_the_moment():
    c = counted("llama_cpp")
    server = serve_http(0, counters=[c])
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        name = (PREFIX + "spec_decode_num_drafts_total", (("engine", "llama_cpp"),))
        with urllib.request.urlopen(url, timeout=10) as r:
            assert values(r.read().decode())[name] == 2
        c.drafted(["pld"])  # read at the scrape: nothing published in between
        with urllib.request.urlopen(url, timeout=10) as r:
            assert values(r.read().decode())[name] == 3
    finally:
        server.shutdown()
        server.server_close()


def test_a_taken_port_is_one_warning(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with caplog.at_level(logging.WARNING, logger="redraft.engines"):
            expose(taken.getsockname()[1])  # no exception: drafting goes on without it
    assert "adapter metrics not served" in caplog.text


ENGINE_PROCESS = textwrap.dedent("""
    import sys
    from redraft.decoder.engines import adapter_prometheus
    from redraft.decoder.engines.adapter_counters import AdapterCounters

    adapter_prometheus.PUBLISH_S = 0.2
    adapter_prometheus.expose()  # PROMETHEUS_MULTIPROC_DIR is set: the publisher starts
    c = AdapterCounters(sys.argv[1])
    c.drafted(["rest", "pld"])
    c.accepted(["rest", "pld"], 1)
    print("COUNTED", flush=True)
    sys.stdin.readline()
    c.drafted(["rest"])  # counted after the last periodic publish: published at exit
""")


def scrape_directory(path: str) -> dict:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    return values(generate_latest(registry).decode())


def test_multiprocess_mode_puts_every_process_on_the_engines_metrics(tmp_path):
    """Two engine processes (an engine core, or two schedulers) publish into one directory;
    the engine's HTTP server (a MultiProcessCollector over it) reports their sums."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", ENGINE_PROCESS, "sglang"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    drafts = (PREFIX + "spec_decode_num_drafts_total", (("engine", "sglang"),))
    try:
        for p in procs:
            assert p.stdout.readline() == "COUNTED\n"
        deadline = time.monotonic() + 30
        while scrape_directory(str(tmp_path)).get(drafts) != 2:  # published while running
            assert time.monotonic() < deadline, scrape_directory(str(tmp_path))
            time.sleep(0.1)
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.wait(30) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()
    got = scrape_directory(str(tmp_path))
    assert got[drafts] == 4
    assert got[(PREFIX + "spec_decode_num_draft_tokens_total",
                (("engine", "sglang"), ("source", "rest")))] == 4
    assert got[(PREFIX + "spec_decode_num_accepted_tokens_total",
                (("engine", "sglang"), ("source", "rest")))] == 2
    assert got[(PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
                (("engine", "sglang"), ("position", "0")))] == 2
    assert sorted(os.listdir(tmp_path)) == sorted(f"counter_{p.pid}-redraft.db" for p in procs)


def test_the_port_setting():
    settings = EngineSettings.read({"service": "127.0.0.1:1"}, environ={
        "REDRAFT_ADAPTER_METRICS_PORT": "9401", "REDRAFT_ADAPTER_METRICS_HOST": "0.0.0.0"})
    assert (settings.metrics_port, settings.metrics_host) == (9401, "0.0.0.0")
    assert EngineSettings.read({}, environ={}).metrics_port is None
    for bad in ("0", "70000", "http", True):
        with pytest.raises(EngineConfigError, match="adapter_metrics_port must be a port"):
            EngineSettings.read({"adapter_metrics_port": bad}, environ={})
