"""Network-facing limits: header timeout, connection caps, handshake deadline, startup grace.

Run as a script, this file is the load generator of the flood test (a separate
process, so the node and the attacker do not share a loop or a GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

HEADER_TIMEOUT_S = 3.0
SLACK_S = 5.0  # a loaded 2-core machine: timers fire late, closes take loop turns, 10,000 of them at once


# -- the load generator (a separate process) ---------------------------------------------
async def _flood(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    connect_gate = asyncio.Semaphore(256)
    lifetimes: list[float] = []
    still_open = 0
    young = 0
    failed = 0
    deadline = loop.time() + args.duration_s

    async def one(i: int) -> None:
        nonlocal still_open, young, failed
        source = f"127.0.0.{2 + i % args.addresses}"
        slow = i % 2 == 0
        async with connect_gate:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(args.host, args.port, local_addr=(source, 0)), 10.0
                )
            except (OSError, TimeoutError):
                failed += 1
                return
        opened = loop.time()
        dripper: asyncio.Task[None] | None = None
        if slow:  # slowloris: a request whose headers never end, one line every line_every_s

            async def drip() -> None:
                writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                n = 0
                while True:
                    await asyncio.sleep(args.line_every_s)
                    n += 1
                    writer.write(b"X-Slow-%d: x\r\n" % n)

            dripper = asyncio.create_task(drip())
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:  # open at the end: a fault only if it has outlived the node's timeout
                    if loop.time() - opened > args.overdue_s:
                        still_open += 1
                    else:
                        young += 1
                    return
                try:
                    data = await asyncio.wait_for(reader.read(4096), left)
                except TimeoutError:
                    continue
                if not data:
                    break
        except OSError:
            pass  # reset by the node: closed as well
        finally:
            if dripper is not None:
                dripper.cancel()
            writer.transport.abort()
        lifetimes.append(loop.time() - opened)

    await asyncio.gather(*(one(i) for i in range(args.slowloris + args.idle)))
    lifetimes.sort()
    return {
        "connected": len(lifetimes) + still_open + young,
        "failed": failed,
        "closed": len(lifetimes),
        "still_open": still_open,
        "young_at_end": young,
        "max_lifetime_s": lifetimes[-1] if lifetimes else 0.0,
        "median_lifetime_s": lifetimes[len(lifetimes) // 2] if lifetimes else 0.0,
    }


def _generator_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slowloris", type=int, default=5000)
    parser.add_argument("--idle", type=int, default=5000)
    parser.add_argument("--addresses", type=int, default=100)
    parser.add_argument("--line-every-s", type=float, default=2.0)
    parser.add_argument("--overdue-s", type=float, default=HEADER_TIMEOUT_S + SLACK_S,
                        help="a connection still open at the end counts as held too long only past this age")
    parser.add_argument("--duration-s", type=float, default=10.0)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.slowloris + args.idle + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))
    import uvloop

    print(json.dumps(uvloop.run(_flood(args))), flush=True)


if __name__ == "__main__":
    _generator_main()
    sys.exit(0)


# -- the tests --------------------------------------------------------------------------------
import pytest  # noqa: E402

from dniasync import ActorSystem  # noqa: E402
from dniasync.node import NodeStatus, NodeStatusReply  # noqa: E402
from dniasync.node.demo import Echo, Ping  # noqa: E402
from dniasync.remote import RemoteSettings, WebSocketTransport  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_flood_of_slow_and_idle_connections_is_capped_and_timed_out(start_node: Any) -> None:
    """5,000 slowloris + 5,000 idle TCP connections from 100 addresses against a node: the member's asks are
    answered throughout (each within its 5 s timeout), file descriptors stay under the cap, and no connection
    outlives the header timeout by more than the slack a loaded machine needs (those opened in the last seconds
    may still be young when the flood ends). The node accounts for every connection it closed."""
    node = start_node("--role", "coordinator", "--spawn", "dniasync.node.demo:Echo=echo",
                      "--header-timeout-s", str(HEADER_TIMEOUT_S))
    cap = RemoteSettings().max_connections
    host, port = node.address.rsplit(":", 1)
    async with ActorSystem() as system, WebSocketTransport(system):
        echo = system.ref(f"echo@{node.address}")
        assert await echo.ask(Ping(0), timeout=5) == 1
        baseline = _fds(node.pid)
        duration = HEADER_TIMEOUT_S + SLACK_S + 6  # longer than any connection may live
        attacker = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--host", host, "--port", port, "--duration-s", str(duration),
            stdout=asyncio.subprocess.PIPE,
        )
        worst_ask = 0.0
        most_fds = baseline
        asks = 0
        newcomer_ok = False
        started = time.monotonic()
        while attacker.returncode is None and time.monotonic() - started < duration + 30:
            t0 = time.monotonic()
            assert await echo.ask(Ping(asks), timeout=5) == asks + 1  # the member is served throughout
            worst_ask = max(worst_ask, time.monotonic() - t0)
            asks += 1
            most_fds = max(most_fds, _fds(node.pid))
            if not newcomer_ok and time.monotonic() - started > 2:
                # a member that connects in the middle of the flood gets in: the flood makes room for it
                async with ActorSystem() as late_system, WebSocketTransport(late_system):
                    assert await late_system.ref(f"echo@{node.address}").ask(Ping(7), timeout=10) == 8
                newcomer_ok = True
            try:
                await asyncio.wait_for(attacker.wait(), 0.2)
            except TimeoutError:
                pass
        assert attacker.stdout is not None
        report = json.loads(await attacker.stdout.read())
        assert attacker.returncode == 0
        status: NodeStatusReply = await system.ref(f"node@{node.address}").ask(NodeStatus(), timeout=5)
    print(report, {"worst_ask_s": worst_ask, "asks": asks, "fds": (baseline, most_fds)}, status.counters)
    assert newcomer_ok
    assert report["connected"] >= 9_000, report
    assert report["still_open"] == 0, report  # nobody held a connection as long as it liked
    assert report["max_lifetime_s"] <= HEADER_TIMEOUT_S + SLACK_S, report
    assert most_fds <= baseline + cap + 16, (baseline, most_fds)
    # Which rule closes a given connection (the header timeout or eviction to make room) is a race with the
    # machine's load: on a busy host the cap evicts every one before its timeout is due. What cannot race: the
    # node closed every connection the flood saw closed, and it counted each under one of its rules.
    c = status.counters
    assert c["connections_evicted"] > 0  # 10,000 connections against a cap of far fewer
    assert c["connections_timed_out"] + c["connections_evicted"] + c["connections_refused"] >= report["closed"], c


# -- one rule at a time, in process ---------------------------------------------------------------
@contextmanager
def raw(address: str, source: str = "127.0.0.1") -> Iterator[socket.socket]:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))
    try:
        yield sock
    finally:
        sock.close()


def closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the node closed ``sock``; ``limit`` if it was still open then."""
    started = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - started < limit:
        try:
            if not sock.recv(65536):
                break
        except TimeoutError:
            continue
        except ConnectionError:
            break
    return time.monotonic() - started


async def test_header_timeout_closes_slow_and_idle_connections_but_not_members() -> None:
    settings = RemoteSettings(header_timeout_s=0.5, heartbeat_s=0.1, detect_s=1.0)
    async with ActorSystem() as server, WebSocketTransport(server, settings=settings) as node:
        await server.spawn(Echo, name="echo")
        async with ActorSystem() as client, WebSocketTransport(client, settings=settings):
            echo = client.ref(f"echo@{node.address}")
            assert await echo.ask(Ping(1), timeout=5) == 2
            with raw(node.address) as slow, raw(node.address) as idle, raw(node.address) as keepalive:
                slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                keepalive.sendall(b"GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                took = await asyncio.gather(*(asyncio.to_thread(closed_after, s, 3.0)
                                              for s in (slow, idle, keepalive)))
            assert all(0.3 < t < 1.5 for t in took), took
            # the member's websocket outlived the timeout many times over
            assert await echo.ask(Ping(2), timeout=5) == 3
            assert node.counters.connections_timed_out == 3
            assert node.counters.peers_lost == 0


async def test_per_address_cap_evicts_the_oldest_stranger_and_keeps_members() -> None:
    settings = RemoteSettings(max_connections=8, max_connections_per_address=3)
    async with ActorSystem() as server, WebSocketTransport(server, settings=settings) as node:
        await server.spawn(Echo, name="echo")
        async with ActorSystem() as client, WebSocketTransport(client):
            echo = client.ref(f"echo@{node.address}")
            assert await echo.ask(Ping(1), timeout=5) == 2  # one trusted connection from 127.0.0.1
            with raw(node.address, "127.0.0.3") as a, raw(node.address, "127.0.0.3") as b:
                await asyncio.sleep(0.1)
                with raw(node.address, "127.0.0.3") as c, raw(node.address, "127.0.0.3") as d:
                    await asyncio.sleep(0.1)
                    assert await asyncio.to_thread(closed_after, a, 1.0) < 1.0  # the oldest made room
                    assert node.guard.connections_from("127.0.0.3") == 3
                    for s in (b, c, d):
                        assert await asyncio.to_thread(closed_after, s, 0.2) >= 0.2
            # the member's websocket from 127.0.0.1 takes none of that address's quota and is never evicted
            with raw(node.address) as e, raw(node.address) as f, raw(node.address) as g:
                await asyncio.sleep(0.1)
                assert await asyncio.to_thread(closed_after, e, 0.2) >= 0.2
                with raw(node.address):
                    await asyncio.sleep(0.1)
                    assert await asyncio.to_thread(closed_after, e, 1.0) < 1.0
                    assert await echo.ask(Ping(2), timeout=5) == 3
                del f, g
            assert node.counters.connections_evicted == 2


async def test_dial_gives_up_on_a_node_that_accepts_and_never_answers() -> None:
    mute = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        mute.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(mute.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        settings = RemoteSettings(handshake_timeout_s=0.5, backoff_min_s=0.05, backoff_max_s=0.1, connect_timeout_s=3.0)
        async with ActorSystem() as system, WebSocketTransport(system, settings=settings):
            t0 = time.monotonic()
            from dniasync.actors import ActorUnreachable

            with pytest.raises(ActorUnreachable, match="cannot connect"):
                await system.ref(f"echo@127.0.0.1:{mute.getsockname()[1]}").ask(Ping(1), timeout=5)
            assert time.monotonic() - t0 < 2.0
            await asyncio.sleep(0.5)
            assert len(accepted) >= 2  # it gave up on the first connection and dialed again
    finally:
        stop.set()
        thread.join()
        for s in accepted:
            s.close()
        mute.close()


def _node_in_thread(settings: RemoteSettings, starting: bool, ready: bool, echo_address: str, block_s: float, linger_s: float,
                    started: threading.Event, done: threading.Event, errors: list[BaseException]) -> str:
    """Runs a node on its own loop in a thread: it asks ``echo_address`` once, then blocks its loop."""
    address: list[str] = []

    async def main() -> None:
        async with ActorSystem() as system, WebSocketTransport(system, settings=settings, starting=starting) as t:
            address.append(t.address)
            await system.ref(echo_address).ask(Ping(0), timeout=5)
            if ready:
                t.mark_ready()
                await asyncio.sleep(0.3)  # the next heartbeat says so
            started.set()
            time.sleep(block_s)  # the loop is stuck: a heavy import, a model being built
            await asyncio.sleep(linger_s)
            done.set()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # reported to the test
            errors.append(exc)
            started.set()
            done.set()

    threading.Thread(target=run, daemon=True).start()
    started.wait(10)
    return address[0] if address else ""


@pytest.mark.parametrize(("starting", "ready"), [(True, False), (False, False), (True, True)])
async def test_a_peer_still_starting_gets_a_grace_period(starting: bool, ready: bool) -> None:
    settings = RemoteSettings(heartbeat_s=0.1, detect_s=0.6, startup_grace_s=5.0)
    async with ActorSystem() as system, WebSocketTransport(system, settings=settings) as node:
        await system.spawn(Echo, name="echo")
        downs: list[str] = []
        node.add_peer_listener(lambda peer, up, reason: downs.append(reason) if "heartbeat" in reason else None)
        started, done, errors = threading.Event(), threading.Event(), []
        await asyncio.to_thread(_node_in_thread, settings, starting, ready, f"echo@{node.address}", 1.5, 0.3,
                                started, done, errors)
        await asyncio.to_thread(done.wait, 10)
        assert not errors
        if starting and not ready:
            assert downs == []
        else:  # the control: the same stall from a node that is (or said it is) ready is a failure
            assert downs and "no heartbeat" in downs[0]


# -- operators' routes beyond loopback (a network namespace of the test's own) ------------------------------------
_BEYOND_LOOPBACK = r'''
import json, re, subprocess, sys, time, urllib.error, urllib.request
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
subprocess.run(["ip", "addr", "add", "10.9.0.1/32", "dev", "lo"], check=True)
token_file, token = sys.argv[1], open(sys.argv[1]).read().strip()
node = subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "coordinator", "--listen", "10.9.0.1:0",
                         "--token-file", token_file, "--metrics-listen", "127.0.0.1:0"],
                        stdout=subprocess.PIPE, text=True)
seen = {}
try:
    for line in node.stdout:
        for key, pattern in (("node", r"listening on (\S+)"), ("metrics", r"metrics on (\S+)")):
            if re.search(pattern, line):
                seen[key] = re.search(pattern, line).group(1)
        if len(seen) == 2:
            break
    def get(url, token=None, host=None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if host:
            headers["Host"] = host
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.read(200).decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, ""
    base = f"http://{seen['node']}"
    print(json.dumps({
        "metrics_without_token": get(base + "/metrics")[0],
        "metrics_wrong_token": get(base + "/metrics", "x" * 32)[0],
        "metrics_with_token": get(base + "/metrics", token)[0],
        "live_without_token": get(base + "/")[0],
        "live_with_token": get(base + "/", token)[0],
        "challenge_without_token": get(base + "/dniasync/challenge?cn=abcdefghijkl")[0],
        "operator_listener": get(seen["metrics"])[0],
        "operator_live_page": get(seen["metrics"].rsplit("/", 1)[0] + "/")[0],
        "operator_live_page_rebound": get(seen["metrics"].rsplit("/", 1)[0] + "/", host="attacker.example")[0],
    }))
finally:
    node.terminate()
    node.wait(10)
'''


def test_metrics_and_live_page_need_the_token_beyond_loopback(tmp_path: Any) -> None:
    token_file = tmp_path / "cluster.token"
    token_file.write_text(os.urandom(24).hex())
    script = tmp_path / "beyond.py"
    script.write_text(_BEYOND_LOOPBACK)
    done = subprocess.run(["unshare", "-n", sys.executable, str(script), str(token_file)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "metrics_without_token": 401, "metrics_wrong_token": 401, "metrics_with_token": 200,
        "live_without_token": 401, "live_with_token": 200,
        "challenge_without_token": 200,  # the wire's own handshake proves the token its own way
        "operator_listener": 200, "operator_live_page": 200,
        "operator_live_page_rebound": 403,  # loopback listener: loopback Host names only (no DNS rebinding)
    }, result
