"""The launcher's side of the chaos tool: fault proxies per link, driven over a loopback control socket.

``DNIASYNC_CHAOS_PROXY=1 python -m dniasync.node --role local ...`` makes the
launcher put a :class:`~dniasync.chaos.FaultProxy` in front of every PS shard
(replicas and the coordinator reach the shard through it) and serve this
control socket on loopback; ``python -m dniasync.chaos`` finds both in
``<output_dir>/cluster.json``. One JSON object per line each way::

    {"fault": "reset", "link": "ps0"}            -> {"ok": true, "connections": 2}
    {"fault": "blackhole", "link": "ps1", "seconds": 5}
    {"fault": "delay", "link": "ps0", "delay_ms": 50, "seconds": 10}
    {"fault": "links"}                           -> {"ok": true, "links": {...}}
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Final

from ._proxy import FaultProxy

__all__ = ["PROXY_ENV", "ChaosControl"]

PROXY_ENV: Final = "DNIASYNC_CHAOS_PROXY"
"""Set to 1 in the launcher's environment to route links through fault proxies."""


class ChaosControl:
    """A loopback line-JSON server that applies faults to the proxies it holds."""

    def __init__(self) -> None:
        self.proxies: dict[str, FaultProxy] = {}
        self.address = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"

    async def add(self, name: str, target: str) -> FaultProxy:
        proxy = FaultProxy(name, target)
        await proxy.start()
        self.proxies[name] = proxy
        return proxy

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await asyncio.gather(*(p.close() for p in self.proxies.values()))
        if self._server is not None:
            await self._server.wait_closed()

    def describe(self) -> dict[str, Any]:
        return {"control": self.address,
                "links": {n: {"address": p.address, "target": p.target} for n, p in self.proxies.items()}}

    def apply(self, request: dict[str, Any]) -> dict[str, Any]:
        fault = request.get("fault")
        if fault == "links":
            return {"ok": True, "links": {n: {"address": p.address, "target": p.target, "connections": p.connections,
                                              "accepted": p.accepted} for n, p in self.proxies.items()}}
        proxy = self.proxies.get(str(request.get("link")))
        if proxy is None:
            return {"ok": False, "error": f"no link {request.get('link')!r}; links: {sorted(self.proxies)}"}
        seconds = float(request.get("seconds", 5.0))
        if fault == "reset":
            return {"ok": True, "connections": proxy.reset()}
        if fault == "blackhole":
            proxy.blackhole(seconds)
            return {"ok": True, "connections": proxy.connections}
        if fault == "delay":
            proxy.delay(float(request.get("delay_ms", 50.0)) / 1000, seconds)
            return {"ok": True, "connections": proxy.connections}
        if fault == "clear":
            proxy.clear()
            return {"ok": True}
        return {"ok": False, "error": f"unknown fault {fault!r} (reset, blackhole, delay, clear, links)"}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    request = json.loads(line)
                    reply = self.apply(request) if isinstance(request, dict) else {"ok": False, "error": "not an object"}
                except ValueError as exc:
                    reply = {"ok": False, "error": f"bad request: {exc}"}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
