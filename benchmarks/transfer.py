"""KV transfer throughput between two processes: ZMQ and UCX backends against a plain TCP socket.

Payload: the KV blocks of a 1k- and an 8k-token SmolLM2-135M request (30 layers, 3 KV heads, head
size 64, block size 16) in float32 and bfloat16, fetched into a second process's cache. Block ids:
`contiguous` (a run on each side, at random offsets: what the engines' block manager hands a request
out of a fresh pool), and `shuffled` (random ids on both sides: the worst case, one segment per
block, layer and K/V).

Methods, all between the same two processes and interleaved round by round so that load from
elsewhere on the machine hits them alike (the median round is reported):
  tcp       a plain socket sending the same number of bytes from one preallocated buffer into
            another: no gather, no scatter, the ceiling any transfer layer can approach;
  tcp_copy  a plain socket moving the blocks the simplest way: gather into a buffer, send, receive
            into a buffer, scatter; one message, no pipelining;
  zmq, ucx  the KV transports (epdserve.transport.transports) as deployed: ZMQ's blocks over its
            block connections (block_stream/), UCX's as UCX messages (ucx/);
  zmq_frames  the ZMQ transport without block connections (as with CURVE): blocks as ZMQ frames.

    python benchmarks/transfer.py                       # every backend available; JSON (+ PNG) in results/
    python benchmarks/transfer.py --backends tcp,zmq --rounds 3 --layouts contiguous
    python benchmarks/transfer.py --profile             # + where the receiving process spends its time
    python benchmarks/transfer.py --checksum            # + what the transfers' checksums cost

Every transfer carries a checksum per segment, taken by the sender and again by the receiver
(transport/kv/checksum.py), so the times above include them. `--checksum` measures what they cost, three ways:
  in the path  each process times (CPU seconds, HashClock) every checksum its data paths take during a
               fetch - the receiver (this process) and the sender (the server process, asked after each
               fetch) - as a share of that fetch's time, per round: `checksum_{receiver,sender}_share_*`;
  alone        one side's checksums of each payload taken alone, from memory - XXH3 over the segments the
               fetch lands (contiguous: one per run, layer and K/V; shuffled: the gathered blocks, in 16 MiB
               messages) - as a share of each transfer's median time: `checksum_ms`, `checksum_share_*` (no
               path hashes like this any more: they hash bytes a copy just touched);
  end to end   the method `zmq_unchecked` (the ZMQ transport with its checksums switched off on both ends: a
               server process of its own, and the client's fetches of it) against `zmq`, per round:
               `checksum_overhead_zmq`.
A quick run: --backends zmq --layouts contiguous --tokens 1024 --dtypes float32 --rounds 2 --runs 1 --checksum.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from epdserve.transport.kv import checksum
from epdserve.transport.kv.client import GATHERED_MESSAGE_BYTES
from epdserve.transport.kv.transfer import Run, as_bytes, gather_blocks, run_views, scatter_blocks

NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 30, 3, 64, 16
MODEL_ID = "SmolLM2-135M-Instruct"
PAYLOAD_TOKENS = (1024, 8192)
DTYPES = ("float32", "bfloat16")
NUM_BLOCKS = max(PAYLOAD_TOKENS) // BLOCK_SIZE + 64
RESULTS = Path(__file__).resolve().parent / "results"
SOCKET_METHODS = ("tcp", "tcp_copy")
# Method -> (backend, server options): the ZMQ backend with blocks as ZMQ frames, as CURVE has them.
# The ZMQ transport without checksums (--checksum): served by a process whose checksums all read 0, fetched
# with the client's switched off alike.
UNCHECKED = "zmq_unchecked"
VARIANTS = {"zmq_frames": ("zmq", {"block_port": None}), UNCHECKED: ("zmq", {})}
LAYOUTS = ("contiguous", "shuffled")


def backend_of(method: str) -> tuple[str, dict]:
    return VARIANTS.get(method, (method, {}))


class _NoChecksum:
    def update(self, piece) -> None:
        pass

    def intdigest(self) -> int:
        return 0


class HashClock:
    """CPU seconds this process spends inside the transfer checksums - checksum.py's functions and its running
    hashes' updates, wherever the data paths call them (socket threads included): their cost in the path,
    with the bytes wherever the path has them then (a piece just received is in the CPU's caches; a segment
    read from memory for the first time is not)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def install(self) -> None:
        """Time every checksum this process takes from now on (its transfer checksums wrapped in place)."""
        checksum.checksum = self._timed(checksum.checksum)  # copy_hashed's hashes are its running digest's
        running = checksum.running
        checksum.running = lambda: _TimedDigest(running(), self._timed)

    def _timed(self, fn):
        def timed(*args, **kwargs):
            started = time.thread_time()  # the CPU's time: a thread the kernel set aside meanwhile costs none
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.thread_time() - started
                with self._lock:
                    self.seconds += elapsed
        return timed

    def take(self) -> float:
        """The seconds since the last take."""
        with self._lock:
            seconds, self.seconds = self.seconds, 0.0
        return seconds


class _TimedDigest:
    def __init__(self, digest, timed) -> None:
        self._digest = digest
        self.update = timed(digest.update)

    def intdigest(self) -> int:
        return self._digest.intdigest()


HASH_CLOCK = HashClock()


@contextlib.contextmanager
def unchecked():
    """This process's transfer checksums switched off (each reads 0), for the `zmq_unchecked` method."""
    taken = checksum.checksum, checksum.running
    checksum.checksum, checksum.running = (lambda buffer: 0), _NoChecksum
    try:
        yield
    finally:
        checksum.checksum, checksum.running = taken


def make_cache(dtype: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    return torch.randn(shape, generator=gen).to(getattr(torch, dtype))


def ucx_available() -> bool:
    try:
        from epdserve.transport.ucx import path as ucx_path
        ucx_path.import_ucxx()
        return True
    except ImportError:
        return False


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        got += conn.recv_into(view[got:])


# ------------------------------------------------------------------------------------------
# Server process


def serve_socket(listener: socket.socket, payload: memoryview, caches: dict[str, torch.Tensor]) -> None:
    """Plain socket server. Request: 8-byte little-endian length n, then
    n == 0 .. : raw mode (high bit clear): answer n bytes of `payload`;
    high bit set: block mode, followed by 1 byte dtype index, 4 bytes count, count int64 block ids:
    answer the gathered blocks."""
    names = list(caches)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                header = conn.recv(8, socket.MSG_WAITALL)
                if len(header) < 8:
                    break
                value = int.from_bytes(header, "little")
                if not value >> 63:
                    conn.sendall(payload[:value])
                    continue
                meta = conn.recv(5, socket.MSG_WAITALL)
                count = int.from_bytes(meta[1:], "little")
                ids = torch.empty(count, dtype=torch.int64)
                _recv_exactly(conn, memoryview(ids.numpy()).cast("B"))
                data = gather_blocks(caches[names[meta[0]]], ids.tolist())
                conn.sendall(memoryview(data.view(torch.uint8).numpy()).cast("B"))


async def run_server(backends: list[str]) -> None:
    from epdserve.transport import transports

    caches = {dtype: make_cache(dtype, seed=1) for dtype in DTYPES}
    servers, addresses = [], {}
    for backend in backends:
        if backend in SOCKET_METHODS:
            continue
        for dtype, cache in caches.items():
            name, options = backend_of(backend)
            server = transports.create_server(name, f"bench-{backend}-{dtype}", kv_cache=cache, model_id=MODEL_ID,
                                               **options)
            address = await server.start()
            addresses[f"{backend}/{dtype}"] = [address, server.expose("bench", range(NUM_BLOCKS))]
            servers.append(server)
    if set(SOCKET_METHODS) & set(backends):
        listener = socket.create_server(("127.0.0.1", 0))
        largest = max(c[:, :, :max(PAYLOAD_TOKENS) // BLOCK_SIZE].nbytes for c in caches.values())
        payload = memoryview(bytearray(os.urandom(1 << 20)) * (largest // (1 << 20) + 1))
        addresses["socket"] = "%s:%d" % listener.getsockname()
        asyncio.get_running_loop().run_in_executor(None, serve_socket, listener, payload, caches)
    print(json.dumps(addresses), flush=True)
    # Until the parent closes stdin: each line it sends asks for the seconds spent in checksums since the last.
    while await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline):
        print(json.dumps(HASH_CLOCK.take()), flush=True)
    for server in servers:
        await server.close()


# ------------------------------------------------------------------------------------------
# Client process (the parent)


class SocketClient:
    def __init__(self, address: str, largest: int):
        host, port = address.rsplit(":", 1)
        self.conn = socket.create_connection((host, int(port)))
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = torch.empty(largest, dtype=torch.uint8)  # preallocated: no page faults

    def raw(self, num_bytes: int) -> None:
        self.conn.sendall(num_bytes.to_bytes(8, "little"))
        _recv_exactly(self.conn, memoryview(self.buffer.numpy())[:num_bytes])

    def blocks(self, cache: torch.Tensor, dtype_index: int, remote: list[int], local: list[int]) -> None:
        ids = torch.tensor(remote, dtype=torch.int64)
        self.conn.sendall((1 << 63).to_bytes(8, "little") + bytes([dtype_index]) + len(remote).to_bytes(4, "little"))
        self.conn.sendall(memoryview(ids.numpy()).cast("B"))
        shape = (cache.shape[0], 2, len(remote), *cache.shape[3:])
        data = self.buffer[:cache[:, :, :len(remote)].nbytes].view(cache.dtype).view(shape)
        _recv_exactly(self.conn, memoryview(self.buffer.numpy())[:data.nbytes])
        scatter_blocks(cache, local, data)


def checksum_seconds(cache: torch.Tensor, layout: str, local: list[int], repeats: int = 5) -> float:
    """One side's checksums of a fetch into `local` blocks of `cache`: XXH3 over the segments as they land
    (a contiguous run: one per layer and K/V; shuffled blocks: gathered, in messages of 16 MiB); the
    median of `repeats`."""
    if layout == "contiguous":
        buffers = run_views(cache, [Run(local[0], len(local))])
    else:
        flat = as_bytes(gather_blocks(cache, local))
        buffers = [flat[i:i + GATHERED_MESSAGE_BYTES] for i in range(0, flat.nbytes, GATHERED_MESSAGE_BYTES)]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        checksum.checksums(buffers)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def block_ids(layout: str, num_blocks: int, gen: torch.Generator) -> list[int]:
    if layout == "shuffled":
        return torch.randperm(NUM_BLOCKS, generator=gen)[:num_blocks].tolist()
    start = int(torch.randint(0, NUM_BLOCKS - num_blocks + 1, (1,), generator=gen))
    return list(range(start, start + num_blocks))


def server_hash_seconds(server: subprocess.Popen) -> float:
    """The seconds the server process spent in checksums since last asked (see HashClock)."""
    server.stdin.write("\n")
    server.stdin.flush()
    return json.loads(server.stdout.readline())


async def run_client(addresses: dict, backends: list[str], rounds: int, layouts: list[str],
                     checksums: bool = False, servers: dict | None = None, tokens=PAYLOAD_TOKENS,
                     dtypes=DTYPES) -> list[dict]:
    """`servers`: backend -> its server process, to ask for its checksums' seconds (with `checksums`)."""
    from epdserve.transport import transports

    caches = {dtype: make_cache(dtype, seed=2) for dtype in DTYPES}
    clients = {
        (backend, dtype): transports.create_client(backend_of(backend)[0], f"client-{backend}-{dtype}", kv_cache=cache,
                                                    model_id=MODEL_ID)
        for backend in backends if backend not in SOCKET_METHODS
        for dtype, cache in caches.items()
    }
    sock = None
    if "socket" in addresses:
        sock = SocketClient(addresses["socket"], max(c.nbytes for c in caches.values()))

    gen = torch.Generator().manual_seed(3)
    results = []
    for layout, (dtype_index, dtype), num_tokens in (
            (layout, d, n) for layout in layouts for d in enumerate(DTYPES) for n in tokens if d[1] in dtypes):
        num_blocks = num_tokens // BLOCK_SIZE
        num_bytes = caches[dtype][:, :, :num_blocks].nbytes
        seconds: dict[str, list[float]] = {b: [] for b in backends}
        # backend -> per round, the shares of the fetch's time the receiving (client) and the sending (server)
        # side spent in checksums
        in_path: dict[str, list[tuple[float, float]]] = {b: [] for b in backends}
        for round_ in range(rounds + 1):  # round 0 warms up connections and allocators
            remote, local = block_ids(layout, num_blocks, gen), block_ids(layout, num_blocks, gen)
            want = make_cache(dtype, seed=1)[:, :, remote] if round_ == rounds else None
            for backend in backends:
                started = time.perf_counter()
                if backend == "tcp":
                    await asyncio.to_thread(sock.raw, num_bytes)
                elif backend == "tcp_copy":
                    await asyncio.to_thread(sock.blocks, caches[dtype], dtype_index, remote, local)
                else:
                    address, generation = addresses[f"{backend}/{dtype}"]
                    HASH_CLOCK.take()
                    with unchecked() if backend == UNCHECKED else contextlib.nullcontext():
                        result = await clients[backend, dtype].fetch_blocks(address, "bench", remote, local,
                                                                            generation=generation, timeout=120)
                    assert result.num_bytes == num_bytes
                elapsed = time.perf_counter() - started
                hashed = None
                if checksums and backend not in SOCKET_METHODS:
                    hashed = HASH_CLOCK.take(), server_hash_seconds(servers[backend])
                if round_:
                    seconds[backend].append(elapsed)
                    if hashed is not None:
                        in_path[backend].append((hashed[0] / elapsed, hashed[1] / elapsed))
                if want is not None and backend != "tcp":  # every block mover landed the exact bytes
                    assert torch.equal(caches[dtype][:, :, local], want), f"{backend} moved wrong bytes"
                    caches[dtype][:, :, local] = 0
        row = {"layout": layout, "dtype": dtype, "num_tokens": num_tokens, "num_blocks": num_blocks,
               "num_bytes": num_bytes}
        for backend, times in seconds.items():
            row[f"{backend}_gbps"] = round(num_bytes / statistics.median(times) / 1e9, 3)
        if "tcp" in backends:
            for backend in backends:
                if backend != "tcp":
                    # Per round, so that a slow phase of the machine hits both sides of the ratio.
                    ratios = [t / s for s, t in zip(seconds[backend], seconds["tcp"])]
                    row[f"{backend}_vs_tcp"] = round(statistics.median(ratios), 3)
        if checksums:
            hashed = checksum_seconds(caches[dtype], layout, local)
            row["checksum_ms"] = round(hashed * 1e3, 2)
            row["checksum_gbps"] = round(num_bytes / hashed / 1e9, 2)
            for backend in (b for b in backends if b not in SOCKET_METHODS):
                row[f"checksum_share_{backend}"] = round(hashed / statistics.median(seconds[backend]), 4)
            for backend in (b for b in backends if b not in SOCKET_METHODS and b != UNCHECKED):
                for side, i in (("receiver", 0), ("sender", 1)):
                    row[f"checksum_{side}_share_{backend}"] = round(
                        statistics.median(shares[i] for shares in in_path[backend]), 4)
            if UNCHECKED in backends and "zmq" in backends:  # per round, as the ratios to the socket
                ratios = [t / u for t, u in zip(seconds["zmq"], seconds[UNCHECKED])]
                row["checksum_overhead_zmq"] = round(statistics.median(ratios) - 1, 4)
        results.append(row)
        print(_format_row(row, backends), flush=True)
    for client in clients.values():
        await client.close()
    return results


async def profile_receives(addresses: dict, backends: list[str], fetches: int = 5) -> list[dict]:
    """Where the receiving process spends a fetch (8k tokens, float32, contiguous blocks): the copy
    from received memory into the cache (`copy_segment`), the one a receive costs beyond the
    socket's, against the fetch's wall time. ZMQ's block connections and UCX receive into the cache:
    they make no such call (cProfile sees the event loop's thread only; the block connections' receiving
    threads call recv_into on the cache's memory, nothing else)."""
    import cProfile
    import pstats

    from epdserve.transport import transports

    num_blocks = max(PAYLOAD_TOKENS) // BLOCK_SIZE
    rows = []
    for backend in (b for b in backends if b not in SOCKET_METHODS):
        cache = make_cache("float32", seed=2)
        client = transports.create_client(backend_of(backend)[0], f"profile-{backend}", kv_cache=cache,
                                           model_id=MODEL_ID)
        ids = list(range(num_blocks))
        address, generation = addresses[f"{backend}/float32"]
        await client.fetch_blocks(address, "bench", ids, ids, generation=generation)  # warm-up
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        for _ in range(fetches):
            await client.fetch_blocks(address, "bench", ids, ids, generation=generation)
        profiler.disable()
        wall = time.perf_counter() - started
        await client.close()
        copy_calls, copy_seconds = 0, 0.0
        for (_, _, name), (_, calls, _, cumulative, _) in pstats.Stats(profiler).stats.items():
            if name == "copy_segment":
                copy_calls, copy_seconds = copy_calls + calls, copy_seconds + cumulative
        rows.append({"backend": backend, "fetch_ms": round(wall / fetches * 1e3, 1),
                     "receive_copy_ms": round(copy_seconds / fetches * 1e3, 1),
                     "receive_copy_share": round(copy_seconds / wall, 3),
                     "receive_copies_per_fetch": copy_calls // fetches})
        print(f"profile {backend}: fetch {rows[-1]['fetch_ms']} ms, copies into the cache beyond the socket's: "
              f"{rows[-1]['receive_copies_per_fetch']} calls, {rows[-1]['receive_copy_ms']} ms "
              f"({rows[-1]['receive_copy_share']:.0%} of the fetch; under the profiler)", flush=True)
    return rows


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Row by row, the median over runs of every measured number (rows are in the same order in each)."""
    medians = []
    for rows in zip(*runs):
        row = dict(rows[0])
        for key, value in rows[0].items():
            if key.endswith(("_gbps", "_vs_tcp", "_ms")) or key.startswith(("checksum_share", "checksum_overhead",
                                                                             "checksum_receiver", "checksum_sender")):
                row[key] = round(statistics.median(r[key] for r in rows), 4)
        medians.append(row)
    return medians


def _format_row(row: dict, backends: list[str]) -> str:
    parts = [f"{row['layout']:>10} {row['dtype']:>8} {row['num_tokens']:>5} tok {row['num_bytes'] / 1e6:6.1f} MB"]
    for backend in backends:
        ratio = f" ({row[f'{backend}_vs_tcp']:.2f}x)" if f"{backend}_vs_tcp" in row else ""
        parts.append(f"{backend} {row[f'{backend}_gbps']:.2f} GB/s{ratio}")
    if "checksum_ms" in row:
        shares = ", ".join(f"{key.removeprefix('checksum_share_')} {value:.1%}" for key, value in row.items()
                           if key.startswith("checksum_share_"))
        overhead = (f"; zmq {row['checksum_overhead_zmq']:+.1%} against zmq_unchecked"
                    if "checksum_overhead_zmq" in row else "")
        in_path = ", ".join(f"{key.removeprefix('checksum_receiver_share_')} "
                            f"{value:.1%} + {row['checksum_sender_share_' + key.removeprefix('checksum_receiver_share_')]:.1%}"
                            for key, value in row.items() if key.startswith("checksum_receiver_share_"))
        parts.append(f"checksums alone, from memory: {row['checksum_ms']:.1f} ms ({row['checksum_gbps']:.1f} GB/s; "
                     f"one side's of a transfer: {shares}{overhead}) | in the path, receiver + sender: {in_path}")
    return " | ".join(parts)


def plot(results: list[dict], backends: list[str], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['layout']}\n{r['dtype']}\n{r['num_tokens']} tok" for r in results]
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(12, 4.8))
    for i, backend in enumerate(backends):
        xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(results))]
        ax.bar(xs, [r[f"{backend}_gbps"] for r in results], width, label=backend)
    ax.set_xticks(range(len(results)), labels)
    ax.set_ylabel("GB/s (median round)")
    ax.set_title("KV block fetch between two processes, SmolLM2-135M layout")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=None,
                        help="comma-separated subset of tcp,tcp_copy,zmq,zmq_frames,ucx (default: all available)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3,
                        help="whole measurements, each with a fresh server process; the table is their median")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ",".join(LAYOUTS))
    parser.add_argument("--tokens", default=",".join(map(str, PAYLOAD_TOKENS)),
                        help="comma-separated subset of the payloads' token counts (a quick run: 1024)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated subset of " + ",".join(DTYPES))
    parser.add_argument("--profile", action="store_true",
                        help="also profile the receiving side of each backend (copies beyond the socket's)")
    parser.add_argument("--checksum", action="store_true",
                        help="also time the checksums: each side's in the path of each transfer, and one side's of "
                             "each payload alone, as shares of the transfer's time")
    parser.add_argument("--output", type=Path, default=RESULTS / "transfer.json")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process
    args = parser.parse_args()
    backends = (args.backends.split(",") if args.backends
                else ["tcp", "tcp_copy", "zmq", "zmq_frames"] + (["ucx"] if ucx_available() else []))
    if args.checksum:
        HASH_CLOCK.install()
    if args.serve:
        with unchecked() if backends == [UNCHECKED] else contextlib.nullcontext():
            asyncio.run(run_server(backends))
        return
    if args.checksum and "zmq" in backends and UNCHECKED not in backends:
        backends.insert(backends.index("zmq") + 1, UNCHECKED)
    if "ucx" not in backends:
        print("ucx: not measured (ucxx not importable, or not requested)")
    # The unchecked method has a server process of its own: the checksums are switched off process-wide.
    served = [group for group in ([b for b in backends if b != UNCHECKED], [UNCHECKED]) if set(group) & set(backends)]
    runs, profiles = [], []
    for run in range(args.runs):
        print(f"run {run + 1} of {args.runs}", flush=True)
        servers = [subprocess.Popen([sys.executable, __file__, "--serve", "--backends", ",".join(group),
                                     *(["--checksum"] if args.checksum else [])],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for group in served]
        try:
            addresses = {key: value for server in servers
                         for key, value in json.loads(server.stdout.readline()).items()}
            serving = {backend: server for group, server in zip(served, servers) for backend in group}
            runs.append(asyncio.run(run_client(addresses, backends, args.rounds, args.layouts.split(","),
                                               args.checksum, serving,
                                               [int(n) for n in args.tokens.split(",")], args.dtypes.split(","))))
            if args.profile:
                profiles.append(asyncio.run(profile_receives(addresses, [b for b in backends if b != UNCHECKED])))
        finally:
            for server in servers:
                server.stdin.close()
                try:
                    server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server.kill()
    results = median_rows(runs)
    if len(runs) > 1:
        print(f"median of {len(runs)} runs:")
        for row in results:
            print(_format_row(row, backends), flush=True)
    report = {
        "benchmark": "kv_transfer",
        "command": "python " + " ".join(sys.argv),
        "layout": {"model": MODEL_ID, "num_layers": NUM_LAYERS, "num_kv_heads": NUM_KV_HEADS,
                   "head_size": HEAD_SIZE, "block_size": BLOCK_SIZE,
                   "block_ids": "contiguous: one run per side; shuffled: random on both sides"},
        "rounds": args.rounds,
        "statistic": (f"each run: the median round, *_vs_tcp the median of per-round ratios to the plain socket; "
                      f"results: the median of {len(runs)} runs (each in `runs`)"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "results": results,
        "runs": runs,
        "receive_profile": profiles or None,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    png = args.output.with_suffix(".png")
    drawn = plot(results, backends, png)
    print(f"wrote {args.output}" + (f" and {png}" if drawn else " (matplotlib not installed: no PNG)"))


if __name__ == "__main__":
    main()
