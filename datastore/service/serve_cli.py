"""`redraft serve`: run the draft service over a datastore directory.

With `--workers N > 1` the parent starts N server processes (spawned, each opening its own
Reader: LMDB environments must not cross fork) on one port with SO_REUSEPORT, sharing
counters and the session limit; SIGTERM, SIGINT or SIGHUP to the parent is passed on (as
SIGTERM), each child finishes its in-flight steps and persists what it learned, and the
parent exits 0 when they have. One process (`--workers 1`) stops the same way on each of
the three.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import ssl
import sys
import time

from redraft.datastore.drafting import uses_native
from redraft.datastore.reader import Reader
from redraft.datastore.service.client import (
    TOKEN_ENV,
    DraftClient,
    client_tls,
    client_token,
    read_tokens,
)
from redraft.datastore.service.config import (
    DRAFTING_CHOICES,
    LEARN_MODES,
    MAX_AUTO_BATCH_THREADS,
    SERVE_LEARN_PERSIST_S,
    THREADS_MIN_SEQUENCES,
    ServiceConfig,
    auto_batch_threads,
)
from redraft.datastore.service.probes import ProbeServer
from redraft.datastore.service.server import STOP_SIGNALS, TLSFiles, serve_forever
from redraft.datastore.service.stats import ServiceStats
from redraft.proto.config_file import add_config_options, print_config
from redraft.proto.errors import RedraftError

UINT32 = (1 << 32) - 1
# The largest --max-batch-entries: a call of this many entries keeps the event loop about a
# second on a CPU core (200,000 closes held every other caller for 5.5 s).
MAX_BATCH_ENTRIES = 65536
MIN_MESSAGE_BYTES = 65536
# A worker that dies is restarted, unless more than RESTART_LIMIT died within
# RESTART_WINDOW_S: then something kills every worker (memory, a bug) and the server stops.
RESTART_LIMIT = 5
RESTART_WINDOW_S = 60.0  # Info of a datastore of many segments, a tree of 1,024 nodes
UINT64 = (1 << 64) - 1
INT32 = (1 << 31) - 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand to the `redraft` parser."""
    d = ServiceConfig()
    p = sub.add_parser(
        "serve",
        help="serve a datastore's drafts over gRPC",
        description="Serve REST and PLD candidate trees over gRPC (redraft.v1.Drafter), with "
        "health checking and reflection. Binds loopback unless --host says otherwise.",
    )
    p.add_argument("--datastore", metavar="DIR",
                   help="datastore directory (required, here or in --config)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 = any free)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="server processes sharing the port (default 1)")
    p.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain (enables TLS)")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key (with --tls-cert)")
    p.add_argument("--token-file", metavar="FILE",
                   help=f"file holding a shared secret clients must send as 'authorization: "
                   f"Bearer <token>' (or set ${TOKEN_ENV})")
    p.add_argument("--max-context", type=int, default=d.max_context_len, metavar="TOKENS",
                   help=f"longest session/request context (default {d.max_context_len})")
    p.add_argument("--max-budget", type=int, default=d.max_budget, metavar="NODES",
                   help=f"largest tree a client may ask for (default {d.max_budget})")
    p.add_argument("--max-depth", type=int, default=d.max_depth,
                   help=f"deepest tree a client may ask for (default {d.max_depth})")
    p.add_argument("--max-sessions", type=int, default=d.max_sessions,
                   help=f"open sessions at once, all workers (default {d.max_sessions})")
    p.add_argument("--tenant-sessions", type=int, default=d.tenant_sessions, metavar="N",
                   help="sessions and sequences one bearer token (without auth, one "
                   "declared tenant, callers that declare none counting as one) may hold at "
                   "once, all workers (default: a fair share, --max-sessions divided by the "
                   "tokens in --token-file; without auth, 7/8 of --max-sessions divided by "
                   "the tenants holding slots, the last 1/8 kept for a tenant to come)")
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s, metavar="SECONDS",
                   help=f"close sessions idle this long (default {d.idle_timeout_s:g})")
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help=f"largest gRPC message (default {d.max_message_bytes})")
    p.add_argument("--budget", type=int, default=d.default_budget,
                   help=f"default tree budget (default {d.default_budget})")
    p.add_argument("--depth", type=int, default=d.default_depth,
                   help=f"default tree depth (default {d.default_depth})")
    p.add_argument("--rest-occurrences", type=int, default=d.rest_max_occurrences, metavar="N",
                   help="occurrences of the longest match sampled per retrieval "
                   f"(default {d.rest_max_occurrences})")
    p.add_argument("--rest-calibration", default=",".join(f"{x:g}" for x in d.rest_calibration),
                   metavar="SCALE,POWER",
                   help="map retrieval probabilities p to SCALE*p**POWER so they compare "
                   "with prompt lookup's (default %(default)s; 1,1 = raw)")
    p.add_argument("--learn", choices=LEARN_MODES, default=d.learn,
                   help="learn from served outputs and draft them for the same tenant (bearer "
                   "token, or the session's declared tenant without auth), for everyone "
                   "(global), or not at all (default %(default)s)")
    p.add_argument("--learn-max-tokens", type=int, default=d.learn_max_tokens, metavar="N",
                   help="tokens of learned outputs kept in memory, oldest evicted first "
                   f"(default {d.learn_max_tokens:,})")
    p.add_argument("--learn-persist-seconds", type=float, default=SERVE_LEARN_PERSIST_S,
                   metavar="SECONDS",
                   help="append learned outputs to the datastore (corpus 'learned') this "
                   "often and at shutdown; 0 = memory only (default %(default)g)")
    p.add_argument("--learn-sync-seconds", type=float, default=d.learn_sync_s,
                   metavar="SECONDS",
                   help="share learned outputs with the other processes serving the same "
                   "datastore (--workers, replicas) this often; each reaches them within "
                   "about twice this (default %(default)g)")
    p.add_argument("--learn-persist-wait", type=float, default=d.learn_persist_wait_s,
                   metavar="SECONDS",
                   help="how long a persist waits for another writer of the datastore "
                   "before it gives up until the next one (default %(default)g)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the background check of the datastore's checksums (by default "
                   "a damaged datastore turns health NOT_SERVING)")
    p.add_argument("--reload-seconds", type=float, default=d.reload_interval_s,
                   metavar="SECONDS",
                   help="look for a new commit of the datastore (append, delete, learned "
                   "outputs) this often and serve it without a restart; 0 = never (default "
                   f"{d.reload_interval_s:g})")
    p.add_argument("--drafting", choices=DRAFTING_CHOICES, default=d.drafting,
                   help="drafting implementation: the compiled core (native), the Python "
                   "reference (python, identical trees, slower; for debugging), or auto "
                   "(native, or $REDRAFT_DRAFTING) (default %(default)s)")
    p.add_argument("--batch-threads", type=int, default=None, metavar="N",
                   help="threads drafting one batched call's sequences, without the GIL "
                   "(default: the cores this process may use divided by --workers, at least 1, "
                   f"at most {MAX_AUTO_BATCH_THREADS}; here {auto_batch_threads()} with one "
                   f"worker); calls of fewer than {THREADS_MIN_SEQUENCES} sequences draft on one "
                   "thread")
    p.add_argument("--batch-offload", type=int, default=d.batch_offload_min, metavar="N",
                   help="a batched call of at least N sequences drafts on a thread, so the "
                   f"server answers other calls meanwhile (default {d.batch_offload_min})")
    p.add_argument("--max-batch-entries", type=int, default=d.max_batch_entries, metavar="N",
                   help="entries plus packed steps one batched call may carry "
                   f"(default {d.max_batch_entries})")
    p.add_argument("--grace", type=float, default=d.grace_s, metavar="SECONDS",
                   help=f"time in-flight calls get after SIGTERM (default {d.grace_s:g})")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve HTTP probes and Prometheus metrics on this port: /healthz, "
                   "/readyz, /metrics, for the whole server (default: off; 0 = any free)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics port binds (default %(default)s)")
    add_config_options(p, "serve")
    p.set_defaults(func=run, config_parser=p)


def check_tls_files(cert: str, key: str) -> None:
    """The certificate chain and key load as a TLS server's (before: garbage in either was
    reported by gRPC as "Failed to bind"). An encrypted key is refused, not prompted for."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        raise RedraftError(f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate "
                           f"chain and its unencrypted private key ({reason})") from None


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    # Upper bounds are what the wire and gRPC can carry (uint32 fields in Limits and
    # DraftParams; gRPC's message limit is a C int): a larger value would start fine and
    # then fail every Info call.
    if args.batch_threads is None:
        args.batch_threads = auto_batch_threads(args.workers if args.workers > 0 else 1)
    bounded = {
        "--max-context": (args.max_context, UINT64), "--max-budget": (args.max_budget, UINT32),
        "--max-depth": (args.max_depth, UINT32), "--max-sessions": (args.max_sessions, UINT32),
        "--idle-timeout": (args.idle_timeout, UINT32),
        "--max-message-bytes": (args.max_message_bytes, INT32),
        "--budget": (args.budget, UINT32), "--depth": (args.depth, UINT32),
        "--workers": (args.workers, 1024), "--rest-occurrences": (args.rest_occurrences, INT32),
        "--learn-max-tokens": (args.learn_max_tokens, UINT64),
        "--batch-threads": (args.batch_threads, 256),
        "--batch-offload": (args.batch_offload, UINT32),
        "--max-batch-entries": (args.max_batch_entries, MAX_BATCH_ENTRIES),
    }
    for flag, (value, most) in bounded.items():
        if not 0 < value <= most:  # also false for nan
            raise RedraftError(f"{flag} must be positive and at most {most}, got {value}")
    if args.max_message_bytes < MIN_MESSAGE_BYTES:
        raise RedraftError(f"--max-message-bytes must be at least {MIN_MESSAGE_BYTES} (a "
                           f"smaller limit refuses the server's own replies, Info's and "
                           f"health's included), got {args.max_message_bytes}")
    for flag, value in (("--grace", args.grace),
                        ("--learn-persist-seconds", args.learn_persist_seconds),
                        ("--learn-persist-wait", args.learn_persist_wait),
                        ("--reload-seconds", args.reload_seconds)):
        if not 0 <= value <= UINT32:
            raise RedraftError(f"{flag} must be between 0 and {UINT32} seconds, got {value}")
    if not 0 <= args.tenant_sessions <= UINT32:
        raise RedraftError(f"--tenant-sessions must be between 0 (auto) and {UINT32}, got "
                           f"{args.tenant_sessions}")
    if not 0.01 <= args.learn_sync_seconds <= 60:  # also false for nan
        raise RedraftError("--learn-sync-seconds must be between 0.01 and 60, got "
                           f"{args.learn_sync_seconds}")
    if not 0 <= args.port < 65536:
        raise RedraftError(f"--port must be in 0..65535, got {args.port}")
    if args.metrics_port is not None:
        if not 0 <= args.metrics_port < 65536:
            raise RedraftError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
        if args.metrics_port == args.port != 0:
            raise RedraftError(f"--metrics-port {args.metrics_port} is --port too: gRPC and "
                               "the HTTP probes need a port each")
    if args.budget > args.max_budget or args.depth > args.max_depth:
        raise RedraftError("--budget/--depth must not exceed --max-budget/--max-depth")
    if args.workers > 1 and args.port == 0:
        raise RedraftError("--workers > 1 needs a fixed --port (the processes share it)")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise RedraftError("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key):
        if path and not os.path.isfile(path):
            raise RedraftError(f"TLS file not found: {path}")
    if args.tls_cert:
        check_tls_files(args.tls_cert, args.tls_key)
    try:
        scale, power = (float(x) for x in args.rest_calibration.split(","))
    except ValueError:
        raise RedraftError(
            f"--rest-calibration takes SCALE,POWER, got {args.rest_calibration!r}") from None
    if not (0 < scale <= 1 and 0 < power < math.inf):  # also false for nan
        raise RedraftError("--rest-calibration needs 0 < SCALE <= 1 and a finite POWER > 0, "
                           f"got {args.rest_calibration!r}")
    try:
        uses_native(args.drafting)  # a core asked for and not built, a bad $REDRAFT_DRAFTING
    except (ValueError, RuntimeError) as exc:
        raise RedraftError(str(exc)) from None
    return ServiceConfig(
        rest_calibration=(scale, power),
        rest_max_occurrences=args.rest_occurrences,
        max_context_len=args.max_context,
        max_budget=args.max_budget,
        max_depth=args.max_depth,
        max_sessions=args.max_sessions,
        tenant_sessions=args.tenant_sessions,
        idle_timeout_s=args.idle_timeout,
        max_message_bytes=args.max_message_bytes,
        default_budget=args.budget,
        default_depth=args.depth,
        grace_s=args.grace,
        verify_checksums=not args.no_verify,
        token=read_tokens(args.token_file) or None,
        learn=args.learn,
        learn_max_tokens=args.learn_max_tokens,
        learn_persist_s=args.learn_persist_seconds,
        learn_sync_s=args.learn_sync_seconds,
        learn_persist_wait_s=args.learn_persist_wait,
        reload_interval_s=args.reload_seconds,
        drafting=args.drafting,
        batch_threads=args.batch_threads,
        batch_offload_min=args.batch_offload,
        max_batch_entries=args.max_batch_entries,
    )


def _announce(line: str) -> None:
    """One write per line: several workers share stdout, and print() may split a line."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on, before gRPC tries it.

    gRPC's own failure is a log line plus an exception in every worker process; this is
    one clear error. It also keeps `--workers N` (SO_REUSEPORT) from joining another
    server's port: the probe binds without SO_REUSEPORT, so any listener makes it fail.
    """
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise RedraftError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    raise RedraftError(
                        f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _worker(datastore: str, host: str, port: int, config: ServiceConfig,
            stats: ServiceStats | None, tls: TLSFiles | None, reuse_port: bool,
            errors=None) -> None:
    """One server process: open the Reader here (never inherit one), serve until signalled.

    A worker process (`errors` given) reports a user error as one line to its parent and
    exits 2, instead of printing a traceback.
    """
    try:
        reader = Reader(datastore)
        parent = os.getppid() if errors is not None else None  # a worker process
        asyncio.run(serve_forever(reader, host, port, config, stats, tls, reuse_port,
                                  _announce, parent_pid=parent))
    except RedraftError as exc:
        if errors is None:
            raise
        errors.put(str(exc))
        sys.exit(2)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if getattr(args, "print_config", False):
        print_config(args.config_parser, args)
        return 0
    if not args.datastore:
        raise RedraftError("--datastore is required (on the command line or in --config)")
    tls = TLSFiles(args.tls_cert, args.tls_key) if args.tls_cert else None
    with Reader(args.datastore):  # fail fast, with the datastore's own error
        pass
    check_port_free(args.host, args.port)
    for line in limit_warnings(config):
        print(f"redraft serve: warning: {line}", file=sys.stderr, flush=True)
    ctx = mp.get_context("spawn") if args.workers > 1 else None
    stats = ServiceStats(ctx, workers=args.workers, tenants=config.tenant_slots())
    probes = None
    if args.metrics_port is not None:
        stats.metrics.enabled = True  # counted from the first call on, in every worker
        probes = ProbeServer(args.metrics_host, args.metrics_port, stats, config).start()
        host = f"[{args.metrics_host}]" if ":" in args.metrics_host else args.metrics_host
        _announce(f"redraft serve: probes and metrics at http://{host}:{probes.port} "
                  "(/healthz, /readyz, /metrics)")
    try:
        return _serve(args, config, tls, stats, ctx)
    finally:
        if probes is not None:
            probes.close()


def _serve(args: argparse.Namespace, config: ServiceConfig, tls: TLSFiles | None,
           stats: ServiceStats, ctx) -> int:
    """Serve in this process (`--workers 1`), or start the workers and watch them."""
    if args.workers == 1:
        _worker(args.datastore, args.host, args.port, config, stats, tls, False)
        return 0
    errors = ctx.SimpleQueue()

    def new_worker(i: int):
        return ctx.Process(target=_worker, name=f"redraft-serve-{i}",
                           args=(args.datastore, args.host, args.port, config, stats, tls, True,
                                 errors))

    procs = [new_worker(i) for i in range(args.workers)]
    replaced: set[int] = set()  # ids of the processes of workers that died and were restarted
    deaths: list[float] = []  # when workers died, for the restart limit
    gave_up = False
    stopping = False

    def forward(signum, _frame) -> None:
        nonlocal stopping
        stopping = True  # workers not started yet never start
        stats.metrics.set_stopping()  # /readyz: 503 from now on
        for proc in procs:
            if proc.is_alive() and proc.pid:
                os.kill(proc.pid, signal.SIGTERM)

    # Before any worker starts: a SIGTERM while they start stops those already running
    # (gracefully) instead of killing this process and leaving them behind.
    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    for proc in procs:
        if not stopping:
            proc.start()
    if stopping:  # a signal during a start missed that worker (no pid yet): tell it now
        forward(signal.SIGTERM, None)
    running = [p for p in procs if p.pid is not None]
    while running:
        mp.connection.wait([p.sentinel for p in running])
        for proc in [p for p in running if not p.is_alive()]:
            running.remove(proc)
            if not proc.exitcode or stopping:
                continue
            if not errors.empty() or gave_up:  # a user error (said by the worker): stop
                forward(signal.SIGTERM, None)
                continue
            # killed (the OOM killer) or crashed: its outputs are in its log, its sessions
            # reconnect; a worker takes its place unless workers keep dying
            now = time.monotonic()
            deaths[:] = [t for t in deaths if now - t < RESTART_WINDOW_S] + [now]
            given = stats.release_worker(proc.pid)
            if len(deaths) > RESTART_LIMIT:
                gave_up = True
                print(f"redraft serve: worker {proc.pid} died ({_death(proc.exitcode)}); "
                      f"{len(deaths)} workers died within {RESTART_WINDOW_S:g} s, giving up",
                      file=sys.stderr, flush=True)
                forward(signal.SIGTERM, None)
                continue
            stats.add(worker_restarts=1)
            replaced.add(id(proc))
            fresh = new_worker(len(procs))
            procs.append(fresh)
            fresh.start()
            running.append(fresh)
            if stopping:  # the signal came while it started
                forward(signal.SIGTERM, None)
            print(f"redraft serve: worker {proc.pid} died ({_death(proc.exitcode)}; "
                  f"{given or 0} session(s) it held were closed); started worker "
                  f"{fresh.pid} in its place ({int(stats.get('worker_restarts'))} restart(s) "
                  f"so far)", file=sys.stderr, flush=True)
    for proc in procs:
        if proc.pid is not None:
            proc.join()
    if not errors.empty():
        raise RedraftError(errors.get())
    # a worker stopped by the signal before it could handle it was stopped as asked
    failed = [p.exitcode for p in procs
              if p.exitcode and id(p) not in replaced
              and not (stopping and not gave_up and p.exitcode == -signal.SIGTERM)]
    if failed:
        print(f"redraft serve: workers exited with {failed}", file=sys.stderr)
        return 1
    return 0


def limit_warnings(config: ServiceConfig) -> list[str]:
    """What the session limits leave some caller without, said at start (they are legal,
    and an operator may mean them, but a token that can never open a session is a surprise
    to find in production)."""
    tokens = len(config.tokens())
    if tokens > config.max_sessions:
        return [f"--max-sessions {config.max_sessions} is fewer than the {tokens} tokens in "
                f"--token-file: while the others hold theirs, {tokens - config.max_sessions} "
                "token(s) find no slot at all"]
    share = config.tenant_share()
    if tokens > 1 and share * tokens > config.max_sessions:
        return [f"--tenant-sessions {share} for {tokens} tokens is more than --max-sessions "
                f"{config.max_sessions}: while some tokens hold their share, the others may "
                "find no slot"]
    return []


def _death(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


def print_server_stats(address: str, token: str | None = None, token_file: str | None = None,
                       tls: bool = False, tls_ca: str | None = None,
                       timeout: float = 5.0) -> int:
    """`redraft stats --server ADDR`: the service's counters as JSON on stdout."""
    with DraftClient(address, token=client_token(token, token_file),
                     tls=client_tls(tls, tls_ca), timeout=timeout) as c:
        json.dump(c.stats(), sys.stdout, indent=2, sort_keys=True)
    print()
    return 0
