"""Auth on the websocket upgrade: the token is proven, never sent; replays and strangers are refused."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from dniasync import ActorSystem
from dniasync.node import GetMembers, NodeStatus, NodeStatusReply
from dniasync.remote import Authenticator, WebSocketTransport

pytestmark = pytest.mark.timeout(60)

TOKEN = b"correct horse battery staple 42"


def token_file(tmp_path: Path, token: bytes, name: str = "token") -> str:
    path = tmp_path / name
    path.write_bytes(token + b"\n")
    path.chmod(0o600)
    return str(path)


async def status(system: ActorSystem, address: str) -> NodeStatusReply:
    reply: NodeStatusReply = await system.ref(f"node@{address}").ask(NodeStatus(), timeout=5)
    return reply


async def handshake_headers(
    session: aiohttp.ClientSession, address: str, token: bytes, check_server: bool = True
) -> dict[str, str]:
    """What a dialer holding ``token`` sends on upgrade (see ``dniasync.remote._auth``)."""
    auth = Authenticator(token)
    client_nonce = auth.client_nonce()
    async with session.get(f"http://{address}/dniasync/challenge", params={"cn": client_nonce}) as resp:
        assert resp.status == 200
        challenge = await resp.json()
    assert not check_server or challenge["proof"] == auth.server_proof(client_nonce, challenge["nonce"], challenge["node"])
    me, incarnation = "127.0.0.1:1", "test-incarnation"
    return {
        "X-Dniasync-Node": me,
        "X-Dniasync-Incarnation": incarnation,
        "X-Dniasync-Nonce": challenge["nonce"],
        "X-Dniasync-Client-Nonce": client_nonce,
        "X-Dniasync-Proof": auth.client_proof(challenge["nonce"], client_nonce, me, challenge["node"], incarnation),
    }


async def test_node_with_wrong_token_is_refused_before_upgrade_and_nothing_is_registered(
    start_node: Any, tmp_path: Path
) -> None:
    coord = start_node("--role", "coordinator", "--token-file", token_file(tmp_path, TOKEN))
    intruder = start_node(
        "--role", "worker", "--join", coord.address, "--token-file", token_file(tmp_path, b"x" * 32, "wrong")
    )
    # the intruder finds out at the challenge (the coordinator's proof does not verify under its token)
    for _ in range(100):
        if "could not prove" in intruder.stderr():
            break
        await asyncio.sleep(0.1)
    assert "could not prove it holds the cluster token" in intruder.stderr()
    async with ActorSystem() as system, WebSocketTransport(system, token=TOKEN):
        reply = await status(system, coord.address)
        assert intruder.address not in reply.peers
        assert reply.counters["connections_accepted"] == 1  # only this honest observer
        members = await system.ref(f"coordinator@{coord.address}").ask(GetMembers(), timeout=5)
        assert [m.node for m in members.members] == [coord.address]
    assert "joined" not in "".join(intruder.output)


async def test_wrong_proof_gets_403_and_no_websocket(start_node: Any, tmp_path: Path) -> None:
    coord = start_node("--role", "coordinator", "--token-file", token_file(tmp_path, TOKEN))
    async with aiohttp.ClientSession() as session:
        headers = await handshake_headers(session, coord.address, b"not the token but long enough", check_server=False)
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await session.ws_connect(f"http://{coord.address}/dniasync/ws", headers=headers)
        assert info.value.status == 403
        async with session.get(f"http://{coord.address}/dniasync/ws", headers=headers) as resp:
            assert resp.status == 403 and "wrong proof" in await resp.text()


async def test_replayed_handshake_is_refused(start_node: Any, tmp_path: Path) -> None:
    coord = start_node("--role", "coordinator", "--token-file", token_file(tmp_path, TOKEN))
    async with aiohttp.ClientSession() as session:
        headers = await handshake_headers(session, coord.address, TOKEN)
        ws = await session.ws_connect(f"http://{coord.address}/dniasync/ws", headers=headers)
        await ws.close()
        async with session.get(f"http://{coord.address}/dniasync/ws", headers=headers) as resp:
            assert resp.status == 403
            assert "replayed" in await resp.text()
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await session.ws_connect(f"http://{coord.address}/dniasync/ws", headers=headers)


@pytest.mark.parametrize(
    ("extra", "why"),
    [({"Origin": "http://evil.example"}, "cross-origin"), ({"Host": "evil.example:80"}, "loopback")],
)
async def test_browser_origins_and_foreign_hosts_are_refused(start_node: Any, extra: dict[str, str], why: str) -> None:
    node = start_node("--role", "coordinator")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{node.address}/dniasync/challenge", params={"cn": "a" * 22}, headers=extra) as r:
            assert r.status == 403 and why in await r.text()
        async with session.get(f"http://{node.address}/dniasync/challenge", params={"cn": "a" * 22}) as r:
            assert r.status == 200


async def test_cluster_with_the_right_token_works(start_node: Any, tmp_path: Path) -> None:
    path = token_file(tmp_path, TOKEN)
    coord = start_node("--role", "coordinator", "--token-file", path)
    worker = start_node("--role", "worker", "--join", coord.address, "--token-file", path)
    worker.wait_for_line("joined the cluster")
    async with ActorSystem() as system, WebSocketTransport(system, token=TOKEN):
        reply = await status(system, coord.address)
        assert reply.peers.get(worker.address) == "up" and reply.counters["auth_failures"] == 0
    worker.signal(signal.SIGTERM)
    assert await asyncio.to_thread(worker.proc.wait, 10) == 0


def test_short_tokens_are_refused(tmp_path: Path) -> None:
    from dniasync.remote import read_token_file

    with pytest.raises(ValueError, match="at least 16"):
        read_token_file(token_file(tmp_path, b"short"))


def test_nonces_expire_and_are_single_use() -> None:
    now = [1000.0]
    server = Authenticator(TOKEN, nonce_ttl_s=5.0, clock=lambda: now[0])
    client = Authenticator(TOKEN)
    nonce = server.issue_server_nonce()
    proof = client.client_proof(nonce, "cn-0123456789", "a:1", "b:2", "inc")
    assert server.check_client(nonce, "cn-0123456789", "a:1", "b:2", "inc", proof) is None
    assert "replayed" in str(server.check_client(nonce, "cn-0123456789", "a:1", "b:2", "inc", proof))
    late = server.issue_server_nonce()
    now[0] += 10
    late_proof = client.client_proof(late, "cn", "a:1", "b:2", "inc")
    assert "expired" in str(server.check_client(late, "cn", "a:1", "b:2", "inc", late_proof))
    forged = Authenticator(TOKEN).issue_server_nonce()
    assert "not issued" in str(server.check_client(forged, "cn", "a:1", "b:2", "inc", "x"))
    # a proof for another node, or another dialer identity, does not verify
    fresh = server.issue_server_nonce()
    other = client.client_proof(fresh, "cn", "a:1", "c:3", "inc")
    assert "wrong proof" in str(server.check_client(fresh, "cn", "a:1", "b:2", "inc", other))
