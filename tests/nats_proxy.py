"""A TCP proxy in front of a nats-server that a test cuts and restores: one client's connection breaks (it
reconnects when restored) while the server and every other client stay up — deterministically."""

from __future__ import annotations

import asyncio
import contextlib

from services.local.infra import free_port


class Proxy:
    """127.0.0.1:port → the NATS server; `cut()` closes every connection and refuses new ones until `restore()`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.server: asyncio.AbstractServer | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def restore(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def cut(self) -> None:
        assert self.server is not None, "restore() first"
        self.server.close()
        await self.server.wait_closed()
        for w in self.writers:
            w.close()
        self.writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
