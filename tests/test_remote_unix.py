"""Same-host links over a Unix socket: offered at the challenge, used only when reachable."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import aiohttp
import pytest

from dniasync import Actor, ActorSystem, handler, message
from dniasync.remote import RemoteSettings, WebSocketTransport
from dniasync.remote._unix import AbstractUnixConnector

pytestmark = pytest.mark.timeout(60)


@message("test.unix.Twice")
@dataclass(frozen=True)
class Twice:
    value: int


class Doubler(Actor):
    @handler
    def twice(self, msg: Twice) -> int:
        return 2 * msg.value


def _families(node: WebSocketTransport) -> list[int]:
    return [conn.ws._writer.transport.get_extra_info("socket").family for conn in node._connections]  # type: ignore[union-attr]


@pytest.mark.parametrize("dialer_unix", [True, False])
async def test_two_nodes_on_one_host_link_over_a_unix_socket_unless_told_not_to(dialer_unix: bool) -> None:
    async with ActorSystem() as server, WebSocketTransport(server) as node:
        await server.spawn(Doubler, name="d")
        assert node.unix_site is not None
        settings = RemoteSettings(unix=dialer_unix)
        async with ActorSystem() as client, WebSocketTransport(client, settings=settings) as dialer:
            ref = client.ref(f"d@{node.address}")
            assert [await ref.ask(Twice(i)) for i in range(50)] == [2 * i for i in range(50)]
            want = socket.AF_UNIX if dialer_unix else socket.AF_INET
            assert _families(dialer) == [want]
            assert _families(node) == [want]
            assert ref.address == f"d@{node.address}"  # the node keeps its TCP name either way


async def test_an_unreachable_unix_socket_sends_the_dialer_back_to_tcp() -> None:
    async with ActorSystem() as server, WebSocketTransport(server) as node:
        await server.spawn(Doubler, name="d")
        assert node.unix_site is not None
        await node.unix_site.stop()  # still offered in the challenge, nobody listens any more
        async with ActorSystem() as client, WebSocketTransport(client) as dialer:
            assert await client.ref(f"d@{node.address}").ask(Twice(21)) == 42
            assert _families(dialer) == [socket.AF_INET]


async def test_the_unix_socket_asks_for_the_same_proof_as_tcp() -> None:
    token = b"unix-secret"
    async with ActorSystem() as server, WebSocketTransport(server, token=token) as node:
        await server.spawn(Doubler, name="d")
        async with ActorSystem() as client, WebSocketTransport(client, token=token) as dialer:
            assert await client.ref(f"d@{node.address}").ask(Twice(1)) == 2
            assert _families(dialer) == [socket.AF_UNIX]
        assert node.unix_site is not None
        name = node.unix_site._sock.getsockname()  # type: ignore[attr-defined]
        failures = node.counters.auth_failures
        async with aiohttp.ClientSession(connector=AbstractUnixConnector(path=name)) as session:
            headers = {"X-Dniasync-Node": "127.0.0.1:9", "X-Dniasync-Incarnation": "x", "X-Dniasync-Proof": "forged"}
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(f"http://{node.address}/dniasync/ws", headers=headers)
        assert refused.value.status == 403
        assert node.counters.auth_failures == failures + 1


async def test_a_node_behind_a_tcp_proxy_stays_behind_it() -> None:
    """A fault proxy in front of a node must keep carrying the link (chaos depends on it): the
    challenge came through a connection whose ends are not the ones the node saw."""
    from dniasync.chaos import FaultProxy

    async with ActorSystem() as server, WebSocketTransport(server) as node:
        await server.spawn(Doubler, name="d")
        proxy = FaultProxy("d", node.address)
        await proxy.start()
        try:
            async with ActorSystem() as client, WebSocketTransport(client) as dialer:
                ref = client.ref(f"d@{proxy.address}")
                assert await ref.ask(Twice(4)) == 8
                assert _families(dialer) == [socket.AF_INET]
        finally:
            await proxy.close()
