"""A fault-injecting TCP proxy for the KV path: sits in front of a prefill's block port and delays or corrupts
what the prefill sends.

    python kv_tap.py --listen 17101 --upstream 127.0.0.1:7101 --control FILE --stats FILE

The chaos suite runs it inside a prefill container's network namespace (`nsenter -t PID -n`), where an
iptables REDIRECT sends every connection a decode opens to the block port here; it forwards them to the real
port on the loopback. Nothing in the services knows it is there.

The block protocol (transport/block_stream/stream.py) is asymmetric: a decode sends a token, then requests
`[u32 length][codec frame of FetchBlocks]`; the prefill answers each with raw segment bytes (and whatever
follows them). Client bytes pass untouched, read only to learn which request each answer belongs to; the
answers are what the faults touch, so every flipped bit lands in KV bytes on their way to the decode's cache:

- `delay` (seconds): each answer starts this much later (a slow link's latency, once per request message);
- `flip` (bool): the first answer for each request id gets one bit flipped in its first 4 KiB (a request's
  later answers, a re-fetch included, pass intact: one flipped fetch per request, so the receiving engine's
  integrity counter must rise by exactly the number of requests flipped).

The control file (JSON, re-read when it changes) sets both; the stats file (JSON) says what was done.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import struct
import sys

TOKEN_BYTES = 32  # block_stream.TOKEN_BYTES: a connection's first bytes from the client
FLIP_WINDOW = 4096  # segments are far larger: a flip here lands in KV bytes, never in what follows them


class Tap:
    def __init__(self, upstream: tuple[str, int], control: str, stats: str, seed: int) -> None:
        self.upstream = upstream
        self.control_path, self.stats_path = control, stats
        self.control_mtime = 0.0
        self.delay = 0.0
        self.flip = False
        self.random = random.Random(seed)
        self.flipped: list[str] = []  # request ids whose first answer got a flipped bit, in order
        self.counts = {"connections": 0, "requests": 0, "answers_delayed": 0}
        self.written: dict | None = None  # the stats last written

    # -- control and stats ----------------------------------------------------------------------------
    async def watch_control(self) -> None:
        """Takes the control file's mode when it changes; writes the stats whenever they changed."""
        while True:
            try:
                mtime = os.stat(self.control_path).st_mtime
                if mtime != self.control_mtime:
                    with open(self.control_path) as f:
                        control = json.load(f)
                    self.control_mtime = mtime
                    self.delay, self.flip = float(control.get("delay", 0.0)), bool(control.get("flip", False))
            except (OSError, ValueError):
                pass  # missing or half-written: keep the last mode
            self.write_stats()
            await asyncio.sleep(0.1)

    def write_stats(self) -> None:
        stats = {**self.counts, "delay": self.delay, "flip": self.flip, "flipped": self.flipped}
        if stats == self.written:
            return
        self.written = copy.deepcopy(stats)
        tmp = self.stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, self.stats_path)

    # -- a connection ----------------------------------------------------------------------------------
    async def serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.counts["connections"] += 1
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        pending: list[str] = []  # request ids whose answer has not started yet, oldest first
        up = asyncio.create_task(self.requests(client_reader, server_writer, pending))
        down = asyncio.create_task(self.answers(server_reader, client_writer, pending))
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
        for writer in (client_writer, server_writer):
            writer.close()

    async def requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: list[str]) -> None:
        """Client -> prefill, unchanged; each FetchBlocks' request id noted for its answer."""
        token = await reader.readexactly(TOKEN_BYTES)
        writer.write(token)
        await writer.drain()
        while True:
            head = await reader.readexactly(4)
            frame = await reader.readexactly(struct.unpack("<I", head)[0])
            pending.append(request_id(frame))
            self.counts["requests"] += 1
            writer.write(head + frame)
            await writer.drain()

    async def answers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: list[str]) -> None:
        """Prefill -> client, each answer delayed and (the first of each request) corrupted as the mode says."""
        while True:
            data = await reader.read(256 << 10)
            if not data:
                return
            if pending:  # the first bytes of an answer: the request it answers is known
                rid = pending.pop(0)
                if self.delay:
                    self.counts["answers_delayed"] += 1
                    await asyncio.sleep(self.delay)
                if self.flip and rid not in self.flipped:
                    data = bytearray(data)
                    bit = self.random.randrange(min(len(data), FLIP_WINDOW) * 8)
                    data[bit // 8] ^= 1 << (bit % 8)
                    self.flipped.append(rid)
                    self.write_stats()
            writer.write(data)
            await writer.drain()


def request_id(frame: bytes) -> str:
    """The request id of a FetchBlocks frame, read with the project's own codec (any other frame: '?')."""
    try:
        from epdserve.transport.channel import codec

        return str(getattr(codec.decode([frame]), "request_id", "?"))
    except Exception:  # noqa: BLE001 - an unreadable frame is forwarded as it is, for the prefill to refuse
        return "?"


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=int, required=True)
    p.add_argument("--upstream", required=True, help="HOST:PORT of the real block port")
    p.add_argument("--control", required=True)
    p.add_argument("--stats", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    host, _, port = args.upstream.rpartition(":")
    tap = Tap((host, int(port)), args.control, args.stats, args.seed)
    tap.write_stats()
    server = await asyncio.start_server(tap.serve, "0.0.0.0", args.listen)
    print(f"kv_tap listening on {args.listen} -> {args.upstream}", file=sys.stderr, flush=True)
    async with server:
        await asyncio.gather(server.serve_forever(), tap.watch_control())


if __name__ == "__main__":
    asyncio.run(main())
