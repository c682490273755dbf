"""The gRPC draft server assembled: options, TLS, health and reflection, start and graceful
shutdown, worker processes' parent watch, and `ServerThread` for embedding.

Why asyncio: a decoder keeps one `Session` stream open per generation and steps it hundreds
of times a second; a thread-per-stream server would pin a thread to every idle session.
Drafting itself is short CPU work (microseconds to a millisecond), so it runs inline on the
event loop and a slow session never blocks another for longer than one draft. For more than
one core, `serve(..., workers=N)` starts N such processes on one port (SO_REUSEPORT) with
shared counters. What each RPC does: `handlers`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from redraft.datastore.service.config import SERVICE_NAME, ServiceConfig
from redraft.datastore.service.handlers import DrafterService, add_drafter_service
from redraft.datastore.service.stats import ServiceStats
from redraft.proto.errors import RedraftError

# Each one stops a server gracefully (SIGHUP: its terminal closed; no reload is meant).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass
class TLSFiles:
    cert: str
    key: str


def server_options(config: ServiceConfig, reuse_port: bool) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]


async def start_server(
    reader,
    host: str = "127.0.0.1",
    port: int = 50051,
    config: ServiceConfig | None = None,
    stats: ServiceStats | None = None,
    tls: TLSFiles | None = None,
    reuse_port: bool = False,
) -> tuple[grpc.aio.Server, DrafterService, health.aio.HealthServicer, int]:
    """Build and start a server on host:port (0 = any free port); returns the bound port."""
    config = config or ServiceConfig()
    stats = stats or ServiceStats(tenants=config.tenant_slots())
    server = grpc.aio.server(options=server_options(config, reuse_port))
    service = DrafterService(reader, config, stats)
    add_drafter_service(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME],
        server,
    )
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if tls is not None:
            with open(tls.key, "rb") as f:
                key = f.read()
            with open(tls.cert, "rb") as f:
                cert = f.read()
            creds = grpc.ssl_server_credentials([(key, cert)])
            bound = server.add_secure_port(address, creds)
        else:
            bound = server.add_insecure_port(address)
    except (RuntimeError, OSError) as exc:
        raise RedraftError(f"cannot listen on {address}: {exc}") from exc
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    service.start_background(health_servicer)
    return server, service, health_servicer, bound


async def serve_forever(reader, host: str, port: int, config: ServiceConfig,
                        stats: ServiceStats | None = None, tls: TLSFiles | None = None,
                        reuse_port: bool = False, announce=print,
                        parent_pid: int | None = None) -> None:
    """Serve until SIGTERM, SIGINT or SIGHUP, then shut down gracefully (in-flight work
    finishes, learned outputs are persisted, a `stopped` line is announced): a closed
    terminal or a Ctrl-C must not lose what was learned.

    A worker process passes `parent_pid`: if that parent dies (even by SIGKILL, which it
    cannot forward), the worker stops too instead of holding the port forever.
    """
    server, service, health_servicer, bound = await start_server(
        reader, host, port, config, stats, tls, reuse_port
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    # Announced once a stop signal is handled: whoever waits for this line may SIGTERM at
    # once (before, the default action killed it, with nothing persisted).
    announce(f"redraft serve: listening on {host}:{bound}")
    orphan_watch = None
    if parent_pid is not None:
        orphan_watch = asyncio.ensure_future(_watch_parent(parent_pid, stop))
    await stop.wait()
    if orphan_watch is not None:
        orphan_watch.cancel()
    await health_servicer.enter_graceful_shutdown()
    await service.shutdown()
    await server.stop(config.grace_s)
    await service.finish()
    announce("redraft serve: stopped")


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)
    stop.set()


class ServerThread:
    """A real server on a background event-loop thread, for tests, benchmarks and embedding.

    Why: the decoder and the tests need the actual gRPC service in-process (no subprocess
    start-up, no mocks); `with ServerThread(reader) as srv: DraftClient(srv.address)`.
    """

    def __init__(self, reader, host: str = "127.0.0.1", port: int = 0,
                 config: ServiceConfig | None = None, tls: TLSFiles | None = None) -> None:
        self.reader = reader
        self.host = host
        self.port = port
        self.config = config or ServiceConfig()
        self.tls = tls
        self.stats = ServiceStats(tenants=self.config.tenant_slots())
        self.service: DrafterService | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._health = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread = threading.Thread(target=self._run, daemon=True, name="redraft-server")
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)

        async def main() -> None:
            try:
                self._server, self.service, self._health, self.port = await start_server(
                    self.reader, self.host, self.port, self.config, self.stats, self.tls
                )
            except BaseException as exc:  # reported to start()'s caller
                self._error = exc
                self._ready.set()
                return
            self._stopped = asyncio.Event()
            self._ready.set()
            await self._stopped.wait()  # set by stop() once the server has fully stopped

        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    def stop(self, grace: float | None = None) -> None:
        """Graceful stop as on SIGTERM: health NOT_SERVING, idle sessions ended, then stop."""
        if self._loop is None or self._server is None or self._loop.is_closed():
            return

        async def shutdown() -> None:
            await self._health.enter_graceful_shutdown()
            await self.service.shutdown()
            await self._server.stop(self.config.grace_s if grace is None else grace)
            await self.service.finish()
            self._stopped.set()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(60)
        except RuntimeError:  # loop already gone
            pass
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=0.5)

