"""A TCP relay that adds latency, for links that are far away (this machine has no `tc netem`).

    with Delay(("10.213.1.2", 22), one_way=0.05) as port:   # ssh -p PORT 127.0.0.1: 100 ms RTT
        ...

Every chunk is held `one_way` seconds in each direction and then sent on; the relay reads as fast
as data arrives, so TCP on either side is never slowed, only anything that waits for a reply
across it: SSH's per-channel flow-control window (OpenSSH: 2 MiB) is what then limits one
stream to about window / RTT, as on a real transatlantic link.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time


class Delay:
    def __init__(self, target: tuple[str, int], one_way: float) -> None:
        self.target, self.one_way = target, one_way
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay", daemon=True)

    def __enter__(self) -> int:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the delay relay did not start")
        return self.port

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        try:
            self.loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held: collections.deque[tuple[float, bytes]] = collections.deque()
        arrived = asyncio.Event()

        async def send() -> None:
            while True:
                while not held:
                    arrived.clear()
                    await arrived.wait()
                due, data = held.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while True:
                data = await reader.read(1 << 18)
                held.append((time.monotonic() + self.one_way, data))
                arrived.set()
                if not data:
                    break
            await sender
        finally:
            sender.cancel()
