"""What each role starts on a node. Pluggable: ``ROLES[name] = starter``."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..actors import Actor, ActorRef, ActorSystem, handler, message
from ..remote import WebSocketTransport
from ._membership import COORDINATOR, MEMBERSHIP, Coordinator, GetMembers, Member, Members, Membership

__all__ = [
    "NEEDS_JOIN",
    "NODE_INFO",
    "ROLES",
    "NodeContext",
    "NodeInfo",
    "NodeStatus",
    "NodeStatusReply",
    "RoleStarter",
    "load_actor_class",
    "register_role",
]

NODE_INFO = "node"
"""Name of the actor on every node that answers :class:`NodeStatus`."""


@dataclass
class NodeContext:
    """What a role starter gets: the node's system, transport and options."""

    system: ActorSystem
    transport: WebSocketTransport
    role: str
    join: str | None
    stop: asyncio.Event
    options: dict[str, Any] = field(default_factory=dict)
    """The ``[node]`` table of the config file merged with the command line."""
    membership: ActorRef | None = None
    """Where this node's view of the cluster lives (the coordinator on the coordinator)."""


RoleStarter = Callable[[NodeContext], Awaitable[None]]


@message("dniasync.node.NodeStatus")
@dataclass(frozen=True)
class NodeStatus:
    pass


@message("dniasync.node.NodeStatusReply")
@dataclass(frozen=True)
class NodeStatusReply:
    node: str
    role: str
    incarnation: str
    peers: dict[str, str]
    counters: dict[str, int]
    members: list[Member]


class NodeInfo(Actor):
    """Answers :class:`NodeStatus`: who this node is, its peers, counters and members."""

    def __init__(self, context: NodeContext) -> None:
        self.context = context

    @handler
    async def status(self, msg: NodeStatus) -> NodeStatusReply:
        transport = self.context.transport
        members: list[Member] = []
        if self.context.membership is not None:
            reply: Members = await self.context.membership.ask(GetMembers(), timeout=5.0)
            members = reply.members
        return NodeStatusReply(
            transport.address,
            self.context.role,
            transport.incarnation,
            transport.peer_states(),
            transport.counters.snapshot(),
            members,
        )


async def start_coordinator(context: NodeContext) -> None:
    context.membership = await context.system.spawn(
        Coordinator, context.transport, context.role, name=COORDINATOR
    )


async def start_member(context: NodeContext) -> None:
    if context.join is None:
        raise ValueError(f"role {context.role} needs --join HOST:PORT (the coordinator's address)")
    context.membership = await context.system.spawn(
        Membership, context.transport, context.join, context.role, name=MEMBERSHIP
    )


ROLES: dict[str, RoleStarter] = {
    "coordinator": start_coordinator,
    "ps": start_member,
    "worker": start_member,
}
"""Role name -> coroutine that starts the role's actors. Training roles extend this."""


NEEDS_JOIN: set[str] = {"ps", "worker"}
"""Roles that cannot start without ``--join``."""


def register_role(name: str, starter: RoleStarter, *, needs_join: bool = False) -> None:
    """Add or replace a role (``python -m dniasync.node --role <name>``)."""
    ROLES[name] = starter
    if needs_join:
        NEEDS_JOIN.add(name)
    else:
        NEEDS_JOIN.discard(name)


def load_actor_class(spec: str) -> tuple[type[Actor], str | None]:
    """``"package.module:Class[=name]"`` -> the actor class and the name to spawn it under."""
    target, _, name = spec.partition("=")
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--spawn expects MODULE:CLASS[=NAME], got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--spawn {spec}: cannot import {module_name}: {exc}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise ValueError(f"--spawn {spec}: {module_name}.{attr} is not an Actor subclass")
    return cls, name or None
