"""In-memory fakes for unit tests of pure handler logic (integration tests use the real broker)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuorch_contracts import Message, route


class RecordingPublisher:
    """A ``Publisher`` that records what was published, in order, with its route."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str, Message]] = []

    async def publish(self, message: Message, *, headers: Mapping[str, Any] | None = None) -> None:
        exchange, key = route(message)
        self.published.append((exchange, key, message))

    def of_type(self, cls: type[Message]) -> list[Any]:
        return [m for _, _, m in self.published if isinstance(m, cls)]


class TcpProxy:
    """A loopback TCP proxy whose connections a test can cut, to prove reconnect paths (as aio-pika's tests do).

    ``await proxy.start()`` listens on 127.0.0.1 at a free port (``proxy.port``); ``await proxy.cut()`` closes
    every open connection at once; new connections are accepted again right after (unless ``refuse`` is set).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self.refuse = False
        self.refused = 0
        """Connections closed at once because ``refuse`` was set."""
        self.cuts = 0
        self._server: Any = None
        self._writers: set[Any] = set()

    async def start(self) -> None:
        import asyncio

        self._server = await asyncio.start_server(self._on_client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _on_client(self, reader: Any, writer: Any) -> None:
        import asyncio

        if self.refuse:
            self.refused += 1
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update({writer, up_writer})

        async def pipe(src: Any, dst: Any) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update({writer, up_writer})

    async def cut(self) -> None:
        self.cuts += 1
        for writer in list(self._writers):
            transport = writer.transport
            transport.abort()
        self._writers.clear()

    async def stop(self) -> None:
        await self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
