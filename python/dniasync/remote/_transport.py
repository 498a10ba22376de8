"""``WebSocketTransport``: one node's websocket server, its dialer and its peers."""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp import web

from ..actors import ActorNotFound, ActorRef, ActorSystem, Backoff, split_address
from ._addresses import DeadDestination, is_loopback, parse_hostport
from ._auth import Authenticator
from ._connection import Connection, WebSocket
from ._guard import ConnectionGuard, GuardedSite
from ._latency import AskLatency
from ._peer import DOWN, NEW, UP, Peer, RemoteDestination, expire_asks
from ._settings import RemoteCounters, RemoteSettings
from ._unix import AbstractUnixConnector, listen_socket, offer, offered_name, socket_name

__all__ = ["PeerListener", "WebSocketTransport", "is_loopback", "parse_hostport"]

log = logging.getLogger("dniasync.remote")

CHALLENGE_PATH = "/dniasync/challenge"
WS_PATH = "/dniasync/ws"
H_NODE = "X-Dniasync-Node"
H_INCARNATION = "X-Dniasync-Incarnation"
H_SERVER_NONCE = "X-Dniasync-Nonce"
H_CLIENT_NONCE = "X-Dniasync-Client-Nonce"
H_PROOF = "X-Dniasync-Proof"
H_STARTING = "X-Dniasync-Starting"

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})

ASK_TICK_S = 0.02
"""How often pending remote asks are checked against their deadlines."""

PeerListener = Callable[[str, bool, str], None]
"""Called with (node, up, reason) when a peer comes up or goes down."""


class WebSocketTransport:
    """Makes an :class:`ActorSystem` a node: listens, dials, multiplexes, detects failures.

    ::

        async with ActorSystem() as system, WebSocketTransport(system, "127.0.0.1:0") as remote:
            await system.spawn(Echo, name="echo")          # echo@127.0.0.1:<port>
            other = system.ref("echo@127.0.0.1:9001")      # an actor on another node
            print(await other.ask(Ping(1)))

    Enter it before spawning: actor addresses name the node (``host:port``).
    ``token`` (bytes) is the shared cluster secret; without one the node
    only listens on loopback. ``advertise`` is the ``host:port`` other nodes
    reach this one at (default: the listen address). ``app`` is the node's
    one aiohttp application; add routes to it before entering.
    ``starting=True`` tells peers this node is still starting (heavy imports,
    models being built), so they tolerate ``settings.startup_grace_s`` of
    silence from it until :meth:`mark_ready`.
    """

    def __init__(
        self,
        system: ActorSystem,
        listen: str = "127.0.0.1:0",
        *,
        token: bytes | None = None,
        advertise: str | None = None,
        settings: RemoteSettings | None = None,
        starting: bool = False,
    ) -> None:
        self.system = system
        self.settings = settings or RemoteSettings()
        self.counters = RemoteCounters()
        self.ask_latency: AskLatency | None = None
        """Round trips of asks to other nodes; off until :meth:`enable_ask_latency` (metrics)."""
        self.auth = Authenticator(token)
        self.incarnation = secrets.token_hex(8)
        self._host, self._port = parse_hostport(listen)
        if not is_loopback(self._host) and token is None:
            raise ValueError(
                f"refusing to listen on non-loopback address {self._host} without a cluster token "
                "(pass token=..., or --token-file on the command line)"
            )
        self._advertise = advertise
        self.address = ""
        self.starting = starting
        self.guard = ConnectionGuard(self.settings, self.counters)
        self.app = web.Application(middlewares=[self.guard.middleware(), self._operator_routes])
        self.app.router.add_get(CHALLENGE_PATH, self._handle_challenge)
        self.app.router.add_get(WS_PATH, self._handle_ws)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._peers: dict[str, Peer] = {}
        self._listeners: list[PeerListener] = []
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._connections: set[Connection] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False
        self.unix_site: GuardedSite | None = None
        """The same-host listener (an abstract Unix socket), if ``settings.unix`` and the OS has one."""
        self._unix_name: str | None = None
        self._unix_sessions: dict[str, aiohttp.ClientSession] = {}

    # -- lifecycle -------------------------------------------------------------------
    async def __aenter__(self) -> WebSocketTransport:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Bind, attach to the system (naming the node ``host:port``), start serving."""
        if self._tg is not None:
            raise RuntimeError("transport already started")
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError:
            sock.close()
            raise
        self._port = sock.getsockname()[1]
        host = self._host if family == socket.AF_INET else f"[{self._host}]"
        self.address = self._advertise or f"{host}:{self._port}"
        self.system.attach_transport(self, self.address)
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._runner = web.AppRunner(
            self.app, access_log=None, handle_signals=False, shutdown_timeout=self.settings.close_timeout_s
        )
        await self._runner.setup()
        await GuardedSite(self._runner, sock, self.guard).start()
        unix = listen_socket() if self.settings.unix else None
        if unix is not None:
            self.unix_site = GuardedSite(self._runner, unix, self.guard)
            await self.unix_site.start()
            self._unix_name = socket_name(unix)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=5.0))
        self.spawn_task(self._watch(), "ws-heartbeat")
        log.info("node %s listening (incarnation %s)", self.address, self.incarnation)

    def mark_ready(self) -> None:
        """This node has started: peers go back to ``detect_s`` for it (told with the next heartbeat)."""
        self.starting = False
        for conn in list(self._connections):
            if not conn.closed:
                conn.ping()

    def enable_ask_latency(self) -> AskLatency:
        """Start timing asks to other nodes (a few list increments per reply)."""
        if self.ask_latency is None:
            self.ask_latency = AskLatency()
        return self.ask_latency

    @property
    def port(self) -> int:
        return self._port

    async def close(self) -> None:
        """Close every connection, fail every pending ask, stop serving. Idempotent."""
        if self._closing or self._tg is None:
            return
        self._closing = True
        for peer in list(self._peers.values()):
            peer.forgotten = True
            peer.down("this node is shutting down")
        await asyncio.gather(*(conn.close() for conn in list(self._connections)))
        if self._session is not None:
            await self._session.close()
        for session in self._unix_sessions.values():
            await session.close()
        if self._runner is not None:
            await self._runner.cleanup()
        for task in list(self._tasks):
            task.cancel()
        await self._tg.__aexit__(None, None, None)

    def spawn_task(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A task owned by this transport, cancelled when it closes."""
        assert self._tg is not None
        task = self._tg.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the Transport protocol of actors -------------------------------------------
    def destination(self, address: str) -> RemoteDestination:
        name, node = split_address(address)
        parse_hostport(node)  # a node is HOST:PORT; refuse anything that would not be a URL's authority
        return RemoteDestination(self, address, name, node)

    def resolve_ref(self, address: str) -> ActorRef:
        """A ref received in a message: local refs resolve to the local actor."""
        try:
            return self.system.ref(address)
        except ActorNotFound:
            if "@" in address and split_address(address)[1] == self.address:
                return ActorRef(address, DeadDestination(address))
            raise

    # -- peers -------------------------------------------------------------------------
    def peer(self, node: str) -> Peer:
        peer = self._peers.get(node)
        if peer is None:
            if self._closing:
                peer = Peer(self, node)
                peer.state, peer.reason = DOWN, "this node is shutting down"
                return peer
            peer = self._peers[node] = Peer(self, node)
        return peer

    def known_peer(self, node: str) -> Peer | None:
        """The peer ``node`` if this node has ever sent to it or heard from it (never creates one)."""
        return self._peers.get(node)

    def peer_states(self) -> dict[str, str]:
        """node -> "new" | "up" | "down" for every node this one knows."""
        return {node: peer.state for node, peer in self._peers.items()}

    def add_peer_listener(self, listener: PeerListener) -> None:
        self._listeners.append(listener)

    def notify(self, node: str, up: bool) -> None:
        peer = self._peers.get(node)
        reason = peer.reason if peer is not None else ""
        if not up:
            self.counters.peers_lost += 1
            quiet = self._closing or reason == "closed by peer"  # an orderly goodbye, not a failure
            log.log(logging.INFO if quiet else logging.WARNING, "peer %s is down: %s", node, reason)
        else:
            log.info("peer %s is up", node)
        for listener in list(self._listeners):
            try:
                listener(node, up, reason)
            except Exception:
                log.exception("peer listener failed")

    def forget(self, node: str) -> None:
        """Stop talking to ``node`` (it left the cluster): no reconnects; asks to it fail."""
        peer = self._peers.pop(node, None)
        if peer is None:
            return
        peer.forgotten = True
        conn = peer.conn
        peer.down("left the cluster")
        if peer.connector is not None:
            peer.connector.cancel()
        if conn is not None:
            self.spawn_task(conn.close(), f"ws-close:{node}")

    def watch_deadlines(self) -> None:
        """Make sure the ask-timeout sweeper runs (it stops when no ask waits)."""
        if self._sweeper is None and not self._closing:
            self._sweeper = self.spawn_task(self._sweep_asks(), "ask-timeouts")

    async def _sweep_asks(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.sleep(ASK_TICK_S)
                if not expire_asks(list(self._peers.values()), loop.time()):
                    return
        finally:
            self._sweeper = None

    def ensure_connecting(self, peer: Peer) -> None:
        if peer.connector is None and not peer.forgotten and not self._closing:
            peer.connector = self.spawn_task(self._connect_loop(peer), f"ws-connect:{peer.node}")

    async def _connect_loop(self, peer: Peer) -> None:
        """Dial until connected, with jittered exponential backoff between attempts."""
        settings = self.settings
        backoff = Backoff(settings.backoff_min_s, settings.backoff_max_s, jitter=0.5)
        attempt = 0
        reconnecting = peer.state == DOWN
        started = asyncio.get_running_loop().time()
        try:
            while not peer.forgotten and not self._closing and peer.state != UP:
                if asyncio.get_running_loop().time() - started > settings.give_up_s:
                    # gone for good (or never listening): forget it; a later ref dials afresh
                    log.info("giving up on %s after %.0f s: %s", peer.node, settings.give_up_s, peer.reason)
                    peer.forgotten = True
                    if self._peers.get(peer.node) is peer:
                        del self._peers[peer.node]
                    break
                if attempt or reconnecting:
                    await asyncio.sleep(backoff.failed())
                    if peer.state == UP:  # the peer dialed us meanwhile
                        break
                attempt += 1
                peer.attempted.clear()
                try:
                    await self._dial(peer)
                except Exception as exc:  # refused, timed out, wrong token, or a peer speaking nonsense
                    if peer.state == NEW:
                        peer.state = DOWN
                    peer.reason = f"cannot connect: {exc}"
                    peer.attempted.set()
                    log.debug("connecting to %s failed (attempt %d): %s", peer.node, attempt, exc)
                    continue
                if reconnecting:
                    self.counters.reconnects += 1
        finally:
            peer.connector = None

    async def _dial(self, peer: Peer) -> None:
        # a peer that accepts and then says nothing (frozen, or hostile) must not hold the dialer
        async with asyncio.timeout(self.settings.handshake_timeout_s):
            await self._handshake(peer)

    async def _handshake(self, peer: Peer) -> None:
        assert self._session is not None
        base = f"http://{peer.node}"
        client_nonce = Authenticator.client_nonce()
        timeout = aiohttp.ClientTimeout(total=self.settings.connect_timeout_s)
        # the websocket may go through the peer's Unix socket: then nothing reuses this TCP connection
        close = {"Connection": "close"} if self.settings.unix else None
        async with self._session.get(
            base + CHALLENGE_PATH, params={"cn": client_nonce}, timeout=timeout, headers=close
        ) as resp:
            if resp.status != 200:
                raise PermissionError(f"challenge refused by {peer.node}: HTTP {resp.status}")
            challenge = await resp.json()
        unix = offered_name(challenge, parse_hostport(peer.node)) if self.settings.unix else None
        server_nonce, server_node = str(challenge["nonce"]), str(challenge["node"])
        incarnation = str(challenge["incarnation"])
        peer_starting = challenge.get("starting") is True
        headers = {
            H_NODE: self.address,
            H_INCARNATION: self.incarnation,
            H_SERVER_NONCE: server_nonce,
            H_CLIENT_NONCE: client_nonce,
        }
        if self.starting:
            headers[H_STARTING] = "1"
        if self.auth.enabled:
            expected = self.auth.server_proof(client_nonce, server_nonce, server_node)
            if not secrets.compare_digest(expected, str(challenge.get("proof", ""))):
                self.counters.auth_failures += 1
                raise PermissionError(f"{peer.node} could not prove it holds the cluster token")
            headers[H_PROOF] = self.auth.client_proof(
                server_nonce, client_nonce, self.address, server_node, self.incarnation
            )
        options: dict[str, Any] = dict(
            headers=headers,
            max_msg_size=self.settings.limits.max_ws_message,
            compress=0,
            autoping=True,
            heartbeat=None,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=self.settings.close_timeout_s),
        )
        ws = None
        if unix is not None:
            try:  # the same host: the websocket through the node's Unix socket, same upgrade, same proof
                ws = await self._unix_session(unix).ws_connect(base + WS_PATH, **options)
            except aiohttp.ClientConnectorError as exc:  # another network namespace, or no longer listening
                log.debug("%s offered a Unix socket this node cannot reach (%s): TCP", peer.node, exc)
        if ws is None:
            ws = await self._session.ws_connect(base + WS_PATH, **options)
        conn = self._adopt(peer.node, incarnation, ws, dialer=self.address)
        conn.peer_starting = peer_starting
        self.spawn_task(self._read(conn), f"ws-read:{peer.node}")

    def _unix_session(self, name: str) -> aiohttp.ClientSession:
        session = self._unix_sessions.get(name)
        if session is None or session.closed:
            session = self._unix_sessions[name] = aiohttp.ClientSession(
                connector=AbstractUnixConnector(path=name), timeout=aiohttp.ClientTimeout(total=None, connect=5.0)
            )
        return session

    async def _read(self, conn: Connection) -> None:
        try:
            await conn.read_loop()
        finally:
            self._connections.discard(conn)

    # -- connections ---------------------------------------------------------------------
    def _adopt(self, node: str, incarnation: str, ws: WebSocket, dialer: str) -> Connection:
        """Register a new authenticated websocket to ``node``; settle simultaneous dials."""
        peer = self.peer(node)
        conn = Connection(self, peer, ws, incarnation, dialer)
        self._connections.add(conn)
        current = peer.conn
        if current is None or current.closed:
            peer.up(conn)
            return conn
        if current.incarnation != incarnation:
            # the peer restarted: whatever was waiting on its old incarnation is lost
            peer.fail_pending("the node restarted")
            self._retire(current)
            peer.up(conn)
            return conn
        if current.dialer != dialer and current.dialer == min(self.address, node):
            # both nodes dialed at once: the connection dialed by the smaller name wins on both sides
            self._retire(conn)
            return conn
        self._retire(current)
        peer.up(conn)
        return conn

    def _retire(self, conn: Connection) -> None:
        """Stop sending on ``conn``; keep reading it briefly so nothing in flight is lost."""
        conn.retired = True
        if conn.peer.conn is conn:
            conn.peer.conn = None
        self.spawn_task(self._close_later(conn), f"ws-retire:{conn.peer.node}")

    async def _close_later(self, conn: Connection) -> None:
        await asyncio.sleep(self.settings.heartbeat_s * 2)
        await conn.close()

    def connection_lost(self, conn: Connection, reason: str) -> None:
        self._connections.discard(conn)
        peer = conn.peer
        if peer.conn is not conn:
            return  # retired or superseded: the peer is still up on another connection
        peer.down(reason)
        if not peer.forgotten and not self._closing:
            self.ensure_connecting(peer)

    async def _watch(self) -> None:
        """Heartbeats out; declare silent peers down (a peer still starting gets ``startup_grace_s``).

        After a stall of this node's own loop, both event loops it may run on
        read pending sockets before timers, so the frames peers sent meanwhile
        are counted before this check runs.
        """
        settings = self.settings
        loop = asyncio.get_running_loop()
        grace = max(settings.startup_grace_s, settings.detect_s)
        while True:
            await asyncio.sleep(settings.heartbeat_s)
            now = loop.time()
            for conn in list(self._connections):
                if conn.closed:
                    continue
                if now - conn.last_rx > (grace if conn.peer_starting else settings.detect_s):
                    silence = now - conn.last_rx
                    self.connection_lost(conn, f"no heartbeat for {silence:.1f} s")
                    self.spawn_task(conn.close(), f"ws-close:{conn.peer.node}")
                else:
                    conn.ping()

    # -- server side --------------------------------------------------------------------
    @web.middleware
    async def _operator_routes(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Routes others add to the app (``/metrics``, the live page) need the token beyond loopback."""
        if (
            not request.path.startswith("/dniasync/")
            and not is_loopback(self._host)
            and not self.auth.check_bearer(request.headers.get("Authorization", ""))
        ):
            self.counters.auth_failures += 1
            raise web.HTTPUnauthorized(
                text="dniasync: this node listens beyond loopback: send 'Authorization: Bearer <cluster token>', "
                "or read it on the node's --metrics-listen address\n",
                headers={"WWW-Authenticate": 'Bearer realm="dniasync"'},
            )
        return await handler(request)

    def _check_origin(self, request: web.Request) -> str | None:
        if request.headers.get("Origin") is not None:
            return "cross-origin requests are not accepted"
        host = request.host.rsplit(":", 1)[0] if not request.host.endswith("]") else request.host
        allowed = self.settings.allowed_hosts
        if allowed is not None:
            return None if host in allowed else f"Host {request.host!r} not allowed"
        if is_loopback(self._host) and host not in _LOOPBACK_NAMES:
            return f"Host {request.host!r} is not a loopback name"
        return None

    def _refuse(self, request: web.Request, why: str) -> web.HTTPForbidden:
        self.counters.auth_failures += 1
        log.warning("refused %s from %s: %s", request.path, request.remote, why)
        return web.HTTPForbidden(text=f"dniasync: {why}\n")

    async def _handle_challenge(self, request: web.Request) -> web.Response:
        why = self._check_origin(request)
        if why is not None:
            raise self._refuse(request, why)
        client_nonce = request.query.get("cn", "")
        if not 8 <= len(client_nonce) <= 64:
            raise self._refuse(request, "missing or malformed client nonce")
        nonce = self.auth.issue_server_nonce()
        body: dict[str, Any] = {"nonce": nonce, "node": self.address, "incarnation": self.incarnation}
        if self.starting:
            body["starting"] = True
        if self.auth.enabled:
            body["proof"] = self.auth.server_proof(client_nonce, nonce, self.address)
        if self._unix_name is not None:
            body.update(offer(self._unix_name, request.transport))
        return web.json_response(body)

    async def _handle_ws(self, request: web.Request) -> web.StreamResponse:
        why = self._check_origin(request)
        headers = request.headers
        node = headers.get(H_NODE, "")
        incarnation = headers.get(H_INCARNATION, "")
        if why is None:
            if not node or len(node) > 300 or not incarnation or len(incarnation) > 64:
                why = "missing node or incarnation header"
            elif self._closing:
                why = "node is shutting down"
            else:
                why = self.auth.check_client(
                    headers.get(H_SERVER_NONCE, ""),
                    headers.get(H_CLIENT_NONCE, ""),
                    node,
                    self.address,
                    incarnation,
                    headers.get(H_PROOF, ""),
                )
        if why is not None:
            raise self._refuse(request, why)
        ws = web.WebSocketResponse(
            max_msg_size=self.settings.limits.max_ws_message,
            compress=False,
            autoping=True,
            heartbeat=None,
            timeout=self.settings.close_timeout_s,
        )
        await ws.prepare(request)
        self.guard.trust(request.transport)
        self.counters.connections_accepted += 1
        conn = self._adopt(node, incarnation, ws, dialer=node)
        conn.peer_starting = headers.get(H_STARTING) == "1"
        try:
            await conn.read_loop()
        finally:
            self._connections.discard(conn)
        return ws
