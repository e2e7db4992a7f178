"""Typed ZMQ channels over real sockets on 127.0.0.1: replies, streams, handshakes, CURVE, dead peers
and hostile frames."""
import asyncio
import dataclasses
import signal
import subprocess
import sys
import threading

import msgpack
import pytest
import zmq
import zmq.asyncio
import zmq.auth
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epdserve.services.cli.launcher import free_port
from epdserve.transport.channel import protocol as p
from epdserve.transport.channel import codec
from epdserve.transport.channel.codec import Limits
from epdserve.transport.channel.common import ChannelError, ChannelTimeout, ErrorReply, HandshakeError, NO_REPLY
from epdserve.transport.channel.peer_auth import PeerAuth
from epdserve.transport.channel.reply_server import PullChannel, ReplyServer
from epdserve.transport.channel.request_client import PushChannel, RequestClient
from epdserve.transport.channel.security import CurveConfig, SecurityError


def status_of(engine_id: str) -> p.Status:
    return p.Status(engine_id, p.Role.PREFILL, p.Health.READY, 10, 20, 1, 2)


async def handle(message, peer):
    """A small service: answers status polls, acks releases, refuses the rest."""
    if isinstance(message, p.StatusRequest):
        return status_of(peer.engine_id)
    if isinstance(message, p.Release):
        return p.Ack(message.request_id)
    if isinstance(message, p.RenewLease):
        await asyncio.sleep(0.05 if message.request_id == "slow" else 0)
        return p.LeaseRenewed(message.request_id, 1.0)
    raise ErrorReply(p.Error(p.ErrorCode.BAD_REQUEST, f"unexpected {type(message).__name__}"))


async def serving(server: ReplyServer):
    await server.start()
    return asyncio.create_task(server.serve(handle))


async def bind_when_free(engine_id: str, port: int) -> ReplyServer:
    """A server on `port`, once the previous owner's listener is gone (libzmq closes it lazily)."""
    for _ in range(50):
        server = ReplyServer(engine_id, port=port)
        try:
            await server.start()
            return server
        except zmq.ZMQError:
            await server.close()
            await asyncio.sleep(0.05)
    raise AssertionError(f"port {port} stayed busy")


def client_of(server_or_address, timeout=5.0, **kwargs) -> RequestClient:
    address = getattr(server_or_address, "address", server_or_address)
    return RequestClient(address, engine_id="proxy-0", role=p.Role.PROXY, timeout=timeout, **kwargs)


def test_request_reply_round_trip_and_error_replies():
    async def main():
        async with ReplyServer("prefill-0") as server:
            task = await serving(server)
            async with client_of(server) as client:
                ack = await client.connect()
                assert ack.engine_id == "prefill-0" and ack.protocol_version == p.PROTOCOL_VERSION
                assert await client.request(p.StatusRequest(), expect=p.Status) == status_of("proxy-0")
                assert await client.request(p.Release("r1")) == p.Ack("r1")
                with pytest.raises(ErrorReply) as info:
                    await client.request(p.Abort("r1"))
                assert info.value.error.code is p.ErrorCode.BAD_REQUEST
            task.cancel()
        assert server.address.startswith("tcp://127.0.0.1:")

    asyncio.run(main())


def test_concurrent_requests_on_one_connection_get_their_own_replies():
    async def main():
        async with ReplyServer("prefill-0") as server:
            task = await serving(server)
            async with client_of(server) as client:
                ids = ["slow" if i % 3 == 0 else f"r{i}" for i in range(60)]
                replies = await asyncio.gather(*(client.request(p.RenewLease(i)) for i in ids))
                assert [r.request_id for r in replies] == ids
            task.cancel()

    asyncio.run(main())


def test_push_pull_keeps_order():
    async def main():
        async with PullChannel("proxy-0") as pull:
            async with PushChannel(pull.address, engine_id="decode-0", role=p.Role.DECODE) as push:
                for i in range(200):
                    await push.send(p.TokenDelta("r1", (i,)))
                await push.send(p.TokenDelta("r1", (), finish_reason=p.FinishReason.LENGTH))
                received = [await pull.recv(timeout=5) for _ in range(201)]
            assert [m.token_ids for m in received[:200]] == [(i,) for i in range(200)]
            assert received[-1].finish_reason is p.FinishReason.LENGTH
            with pytest.raises(ChannelTimeout):
                await pull.recv(timeout=0.05)
            assert pull.num_rejected == 0

    asyncio.run(main())


def test_client_reconnects_to_a_restarted_server():
    async def main():
        server = ReplyServer("prefill-a")
        task = await serving(server)
        port = server.address.rsplit(":", 1)[1]
        async with client_of(server) as client:
            assert (await client.request(p.StatusRequest())).engine_id == "proxy-0"
            assert client.peer.engine_id == "prefill-a"
            task.cancel()
            await server.close()
            # Same port, new process state: it knows nothing of the client's handshake.
            server = await bind_when_free("prefill-b", int(port))
            task = asyncio.create_task(server.serve(handle))
            # A request sent before ZMQ noticed the old connection drop is lost with it (at most
            # once): it fails (connection lost) or times out. Once reconnected, requests go through
            # without the caller's help.
            reply = None
            for _ in range(20):
                try:
                    reply = await client.request(p.Release("r9"), timeout=1.0)
                    break
                except ChannelError:
                    continue
            assert reply == p.Ack("r9")
            assert client.peer.engine_id == "prefill-b"  # handshake redone transparently
        task.cancel()
        await server.close()

    asyncio.run(main())


def test_client_started_before_its_server_connects_when_it_appears():
    async def main():
        # A port from a plain socket, closed synchronously: a ZMQ probe server's listener would close
        # lazily and could accept (and then drop, with the handshake in it) the client's first connection.
        port = free_port()
        async with client_of(f"tcp://127.0.0.1:{port}", timeout=10) as client:
            pending = asyncio.create_task(client.request(p.StatusRequest()))
            await asyncio.sleep(0.2)
            server = ReplyServer("late", port=port)
            await server.start()
            task = asyncio.create_task(server.serve(handle))
            assert isinstance(await pending, p.Status)
            task.cancel()
            await server.close()

    asyncio.run(main())


def test_unreachable_peer_times_out_instead_of_hanging():
    async def main():
        async with client_of(f"tcp://127.0.0.1:{free_port()}", timeout=0.3) as client:  # nobody listens
            with pytest.raises(ChannelTimeout, match="no handshake answer"):
                await client.request(p.StatusRequest())

    asyncio.run(main())


SLOW_SERVER = """
import asyncio
from epdserve.transport.channel import protocol as p
from epdserve.transport.channel.reply_server import ReplyServer

async def handle(message, peer):
    if isinstance(message, p.StatusRequest):
        return p.Status("sub", p.Role.PREFILL, p.Health.READY, 1, 1, 0, 0)
    await asyncio.sleep(3600)  # never answers anything else: the test kills us meanwhile

async def main():
    server = ReplyServer("sub")
    print(await server.start(), flush=True)
    await server.serve(handle)

asyncio.run(main())
"""


def test_peer_killed_mid_request_fails_it_at_once():
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()

        async def main():
            async with client_of(address, timeout=60.0) as client:
                assert (await client.request(p.StatusRequest())).engine_id == "sub"
                pending = asyncio.create_task(client.request(p.Release("r1")))
                await asyncio.sleep(0.3)  # the server holds the request...
                proc.kill()  # ...and dies with it: the dropped connection fails it, long before its timeout
                with pytest.raises(ChannelError, match="lost"):
                    await asyncio.wait_for(pending, 10)
                assert client.num_disconnects == 1
                with pytest.raises(ChannelTimeout):
                    await client.request(p.StatusRequest(), timeout=0.5)

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_peer_is_down_at_once_and_a_short_request_does_not_wait_for_a_long_ones_handshake():
    """After the kill, a request with a long timeout starts a handshake with the dead peer; a status poll
    with a short one must fail at its own deadline, not queue behind that handshake."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()

        async def main():
            async with client_of(address, timeout=60.0) as client:
                assert (await client.request(p.StatusRequest())).engine_id == "sub" and not client.is_down
                proc.kill()
                proc.wait()
                while not client.is_down:  # the kernel closed the connection: the monitor says so
                    await asyncio.sleep(0.01)
                long = asyncio.create_task(client.request(p.StatusRequest(), timeout=60.0))
                await asyncio.sleep(0.1)  # it holds the handshake
                with pytest.raises(ChannelTimeout):
                    await client.request(p.StatusRequest(), timeout=0.5)
                assert not long.done()
                long.cancel()

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("fail_if_refused", [False, True], ids=["waits", "fails_if_refused"])
def test_a_frozen_peer_is_down_within_the_heartbeat_timeout(fail_if_refused):
    """SIGSTOP: the connection stays open, but the peer's libzmq no longer answers heartbeats. Once it wakes,
    the next request reconnects - also from a client that fails at once where a connect is refused: libzmq
    announces the reconnect of a dropped connection as a retried connect, which is no refusal."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()

        async def main():
            async with client_of(address, timeout=60.0, fail_if_refused=fail_if_refused) as client:
                assert (await client.request(p.StatusRequest())).engine_id == "sub"
                pending = asyncio.create_task(client.request(p.Release("r1")))
                proc.send_signal(signal.SIGSTOP)
                with pytest.raises(ChannelError, match="lost"):  # long before the request's own 60 s
                    await asyncio.wait_for(pending, 30)
                assert client.is_down
                proc.send_signal(signal.SIGCONT)  # it wakes: the next request reconnects
                # ... sent once the client took in the events that follow the drop (the reconnect itself comes
                # 100 ms later): the request must wait for it, not fail as if nothing listened there.
                await asyncio.sleep(0.02)
                assert (await client.request(p.StatusRequest(), timeout=30)).engine_id == "sub"
                assert not client.is_down

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------------------------
# Handshake refusals


def test_protocol_version_mismatch_is_refused_at_handshake():
    async def main():
        async with ReplyServer("prefill-0") as server:
            task = await serving(server)
            async with client_of(server) as client:
                client._hello = dataclasses.replace(client._hello, protocol_version=p.PROTOCOL_VERSION + 1)
                with pytest.raises(HandshakeError, match="version_mismatch"):
                    await client.connect()
            task.cancel()

    asyncio.run(main())


def test_handshake_check_refuses_incompatible_peers():
    async def only_decoders(hello: p.Handshake):
        return None if hello.role is p.Role.DECODE else f"{hello.role.value} may not connect here"

    async def main():
        async with ReplyServer("prefill-0", check_handshake=only_decoders) as server:
            task = await serving(server)
            async with client_of(server) as proxy:
                with pytest.raises(HandshakeError, match="proxy may not connect"):
                    await proxy.request(p.StatusRequest())
            async with RequestClient(server.address, engine_id="d", role=p.Role.DECODE) as decoder:
                assert isinstance(await decoder.request(p.StatusRequest()), p.Status)
            task.cancel()

    asyncio.run(main())


def test_client_refuses_a_server_speaking_another_version():
    async def main():
        ctx = zmq.asyncio.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")

        async def fake_server():
            identity, corr, *_ = await router.recv_multipart()
            reply = msgpack.packb([p.PROTOCOL_VERSION + 1, "handshake_ack", {}])
            await router.send_multipart([identity, corr, reply])

        task = asyncio.create_task(fake_server())
        async with client_of(f"tcp://127.0.0.1:{port}") as client:
            with pytest.raises(HandshakeError, match="protocol version"):
                await client.connect()
        await task
        router.close(linger=0)

    asyncio.run(main())


def test_wildcard_bind_must_be_asked_for():
    for host in ("*", "0.0.0.0", "::"):
        with pytest.raises(SecurityError):
            ReplyServer("x", host=host)
    from epdserve.transport.channel.security import bind_endpoint
    assert bind_endpoint("0.0.0.0", 5555, allow_wildcard=True) == "tcp://0.0.0.0:5555"
    assert bind_endpoint("127.0.0.1", 0) == "tcp://127.0.0.1:*"


# ---------------------------------------------------------------------------------------------
# The deployment's secret


def test_a_peer_must_prove_the_deployment_secret_and_the_server_proves_it_back():
    secret, other = b"a" * 32, b"b" * 32

    checked = []  # hellos the server's own check saw (a UCX path's: it parses the peer's worker address)

    async def check(hello):
        checked.append(hello.engine_id)
        return None

    async def main():
        async with ReplyServer("kvstore-0", auth=PeerAuth(secret), check_handshake=check) as server:
            task = await serving(server)
            async with client_of(server, auth=PeerAuth(secret)) as client:
                assert isinstance(await client.request(p.StatusRequest()), p.Status)
            for auth, why in ((None, "no proof"), (PeerAuth(other), "wrong proof")):
                async with client_of(server, auth=auth) as client:
                    with pytest.raises(HandshakeError, match=f"unauthenticated: kvstore-0: {why}"):
                        await client.request(p.StatusRequest())
            assert server.num_auth_denied == 2 and server.rejected_by_reason["unauthenticated"] == 2
            assert checked == ["proxy-0"]  # only the proven hello got as far as the server's own check
            # A recorded hello is not admitted again.
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(server.address)
            nonce, proof = PeerAuth(secret).hello("prefill", "prefill-9")
            hello = p.Handshake(p.PROTOCOL_VERSION, p.Role.PREFILL, "prefill-9", auth_nonce=nonce, auth_proof=proof)
            answers = []
            for corr in (1, 2):
                await sock.send_multipart([corr.to_bytes(8, "little"), *codec.encode(hello)])
                answers.append(codec.decode((await sock.recv_multipart())[1:]))
            sock.close()
            assert isinstance(answers[0], p.HandshakeAck)
            assert isinstance(answers[1], p.Error) and "replayed" in answers[1].message
            task.cancel()
        # A server without the secret (an impostor at a service's address) is refused by the client.
        async with ReplyServer("prefill-0") as impostor:
            task = await serving(impostor)
            async with client_of(impostor, auth=PeerAuth(secret)) as client:
                with pytest.raises(HandshakeError, match="did not prove this deployment's secret"):
                    await client.request(p.StatusRequest())
            task.cancel()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# CURVE


@pytest.fixture()
def certificates(tmp_path):
    keys = {}
    for name in ("server", "client", "stranger"):
        keys[name] = zmq.auth.create_certificates(tmp_path, name)  # (public file, secret file)
    return keys


def test_curve_admits_listed_clients_and_refuses_others(certificates):
    server_public, server_secret = certificates["server"]
    client_public, client_secret = certificates["client"]
    _, stranger_secret = certificates["stranger"]
    server_curve = CurveConfig(server_secret, allowed_clients=(client_public,))

    async def main():
        async with ReplyServer("prefill-0", curve=server_curve) as server:
            task = await serving(server)
            good = CurveConfig(client_secret, server_public_key_file=server_public)
            async with client_of(server, curve=good) as client:
                assert isinstance(await client.request(p.StatusRequest()), p.Status)

            refused = [
                CurveConfig(stranger_secret, server_public_key_file=server_public),  # not on the allow-list
                CurveConfig(client_secret, server_public_key_file=client_public),  # wrong server key
                None,  # no CURVE at all
            ]
            for curve in refused:
                async with client_of(server, timeout=1.5, curve=curve) as client:
                    with pytest.raises((HandshakeError, ChannelTimeout)):
                        await client.request(p.StatusRequest())
            assert server.num_auth_denied >= 1
            task.cancel()

    asyncio.run(main())


def test_curve_stranger_is_refused_with_a_handshake_error(certificates):
    server_public, server_secret = certificates["server"]
    client_public, _ = certificates["client"]
    _, stranger_secret = certificates["stranger"]

    async def main():
        async with ReplyServer("prefill-0", curve=CurveConfig(server_secret, allowed_clients=(client_public,))) as server:
            task = await serving(server)
            stranger = CurveConfig(stranger_secret, server_public_key_file=server_public)
            async with client_of(server, timeout=5, curve=stranger) as client:
                with pytest.raises(HandshakeError, match="refused the connection"):
                    await client.connect()
            task.cancel()

    asyncio.run(main())


def test_curve_config_errors_are_typed(tmp_path, certificates):
    server_public, _ = certificates["server"]
    with pytest.raises(SecurityError, match="no secret key"):
        CurveConfig(server_public).keypair()
    with pytest.raises(SecurityError, match="cannot load"):
        CurveConfig(tmp_path / "missing.key_secret").keypair()


# ---------------------------------------------------------------------------------------------
# Hostile frames against a running server (a real socket, a server loop in a thread)


class ServerThread:
    """A ReplyServer on its own event loop thread, so a plain blocking socket can talk to it."""

    def __init__(self, **kwargs):
        self.loop = asyncio.new_event_loop()
        self.server = ReplyServer("target", **kwargs)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        self.task = asyncio.run_coroutine_threadsafe(self.server.serve(handle), self.loop)

    def close(self):
        self.task.cancel()
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


LIMITS = Limits(max_message_bytes=8 << 10, max_tensor_bytes=64 << 10, max_str_len=1 << 10, max_list_len=256)


@pytest.fixture(scope="module")
def target():
    server = ServerThread(limits=LIMITS)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 5000
    sock.connect(server.server.address)
    sock.send_multipart([b"\x01" * 8, *codec.encode(p.Handshake(p.PROTOCOL_VERSION, p.Role.PROXY, "fuzzer"))])
    corr, *reply = sock.recv_multipart()
    assert isinstance(codec.decode(reply), p.HandshakeAck)
    yield server.server, sock
    sock.close()
    server.close()


def _still_answers(sock) -> None:
    sock.send_multipart([b"\x02" * 8, *codec.encode(p.StatusRequest())])
    while True:  # skip any Error replies the hostile frames earned (version mismatches)
        corr, *reply = sock.recv_multipart()
        if corr == b"\x02" * 8:
            assert isinstance(codec.decode(reply), p.Status)
            return


def _valid_body(tag):
    sample = {
        "fetch_blocks": p.FetchBlocks("r", 1, (1, 2), (2,)),
        "prefill_request": p.PrefillRequest("r", (1, 2, 3), p.WireSamplingParams(stop=("x",))),
        "status": status_of("e"),
        "abort": p.Abort("r"),
    }[tag]
    return codec._MESSAGES[tag].to_wire(sample, tag)


def _wrong_value():
    packable = st.integers(-2**63, 2**64 - 1)  # msgpack's integer range: the sender must encode it
    return st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=8),
                     st.binary(max_size=8), st.lists(packable, max_size=3),
                     st.dictionaries(st.text(max_size=3), packable, max_size=2))


@st.composite
def hostile_message(draw):
    """Frames (after the correlation id) that a correct server must drop, and why."""
    kind = draw(st.sampled_from(["random", "truncated", "wrong_type", "unknown_field", "missing_field",
                                 "unknown_tag", "oversized", "version", "extra_frame", "bad_tensor"]))
    tag = draw(st.sampled_from(["fetch_blocks", "prefill_request", "status", "abort"]))
    body = _valid_body(tag)
    if kind == "random":
        data = draw(st.binary(min_size=0, max_size=300))
        try:
            codec.decode([data], LIMITS)
        except codec.DecodeError:
            return [data]
        return [b"\xc1"]  # the (vanishingly rare) valid draw is replaced by an invalid byte
    if kind == "truncated":
        frame = msgpack.packb([p.PROTOCOL_VERSION, tag, body], use_bin_type=True)
        return [frame[:draw(st.integers(0, len(frame) - 1))]]
    if kind == "wrong_type":
        field = draw(st.sampled_from(sorted(body)))
        frame = msgpack.packb([p.PROTOCOL_VERSION, tag, {**body, field: draw(_wrong_value())}], use_bin_type=True)
        try:
            codec.decode([frame], LIMITS)
        except codec.DecodeError:
            return [frame]
        # The drawn value happened to fit the field; no field of any message accepts this one.
        return [msgpack.packb([p.PROTOCOL_VERSION, tag, {**body, field: {"not_a_field": 1}}])]
    if kind == "unknown_field":
        return [msgpack.packb([p.PROTOCOL_VERSION, tag, {**body, "zz_" + draw(st.text(max_size=5)): 1}])]
    if kind == "missing_field":
        field = draw(st.sampled_from(sorted(body)))
        return [msgpack.packb([p.PROTOCOL_VERSION, tag, {k: v for k, v in body.items() if k != field}])]
    if kind == "unknown_tag":
        return [msgpack.packb([p.PROTOCOL_VERSION, "x_" + draw(st.text(max_size=10)), body])]
    if kind == "oversized":
        return [msgpack.packb([p.PROTOCOL_VERSION, "abort", {"request_id": "r", "reason": "x" * (9 << 10)}])]
    if kind == "version":
        return [msgpack.packb([draw(st.integers(2, 2**31).filter(lambda v: v != p.PROTOCOL_VERSION)), tag, body])]
    if kind == "extra_frame":
        return [msgpack.packb([p.PROTOCOL_VERSION, tag, body]), draw(st.binary(max_size=16))]
    # bad_tensor: a header that disagrees with its frame
    header = {"dtype": draw(st.sampled_from(["float32", "bfloat16", "int64"])), "shape": [4, 4]}
    frame = draw(st.binary(max_size=40))
    return [msgpack.packb([p.PROTOCOL_VERSION, "embeddings_data", {"mm_hash": "h", "data": header}]), frame]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(st.lists(hostile_message(), min_size=1, max_size=5))
def test_hostile_frames_are_dropped_counted_and_the_server_keeps_answering(target, messages):
    server, sock = target
    before = server.num_rejected
    for frames in messages:
        sock.send_multipart([b"\x03" * 8, *frames])
    _still_answers(sock)  # replies come in order on one connection: every frame above was handled
    assert server.num_rejected == before + len(messages)


def test_frames_without_a_proper_envelope_are_dropped(target):
    server, sock = target
    before = server.num_rejected
    sock.send_multipart([b"short"])  # no message after the correlation id
    sock.send_multipart([b"\x03" * 7, *codec.encode(p.StatusRequest())])  # correlation id of 7 bytes
    _still_answers(sock)
    assert server.num_rejected == before + 2
    assert server.rejected_by_reason["envelope"] >= 2


def test_oversized_and_version_frames_are_counted_by_reason(target):
    server, sock = target
    by_reason = dict(server.rejected_by_reason)
    sock.send_multipart([b"\x04" * 8, msgpack.packb([p.PROTOCOL_VERSION, "abort", {"reason": "x" * (9 << 10)}])])
    sock.send_multipart([b"\x05" * 8, msgpack.packb([p.PROTOCOL_VERSION + 1, "status_request", {}])])
    corr, *reply = sock.recv_multipart()  # the version mismatch is answered, so the peer fails fast
    assert corr == b"\x05" * 8
    error = codec.decode(reply)
    assert isinstance(error, p.Error) and error.code is p.ErrorCode.VERSION_MISMATCH
    _still_answers(sock)
    assert server.rejected_by_reason["oversized"] == by_reason.get("oversized", 0) + 1
    assert server.rejected_by_reason["version"] == by_reason.get("version", 0) + 1


def test_messages_before_the_handshake_are_refused():
    server = ServerThread()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger, sock.rcvtimeo = 0, 5000
    try:
        sock.connect(server.server.address)
        sock.send_multipart([b"\x01" * 8, *codec.encode(p.StatusRequest())])
        corr, *reply = sock.recv_multipart()
        error = codec.decode(reply)
        assert isinstance(error, p.Error) and error.code is p.ErrorCode.HANDSHAKE_REQUIRED
        sock.send_multipart([NO_REPLY, *codec.encode(p.Release("r"))])  # a push: refused without a reply
        sock.send_multipart([b"\x02" * 8, *codec.encode(p.Handshake(p.PROTOCOL_VERSION, p.Role.PROXY, "x"))])
        corr, *reply = sock.recv_multipart()
        if corr == NO_REPLY:  # the refusal of the push, sent so that a pusher learns to handshake again
            corr, *reply = sock.recv_multipart()
        assert isinstance(codec.decode(reply), p.HandshakeAck)
        assert server.server.rejected_by_reason["no_handshake"] == 2  # counted (and logged): a push is lost
    finally:
        sock.close()
        server.close()
