"""Cluster membership: the coordinator's table and each member's view of it.

Nodes join by asking ``coordinator@<join address>``; the coordinator tells
every member about joins and departures (a member that leaves, or whose
connection the failure detector declares dead). A member rejoins by itself
when the coordinator comes back after being unreachable.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from ..actors import Actor, ActorError, ActorRef, Backoff, handler, message
from ..remote import WebSocketTransport
from ..train.messages import CoordinatorEpoch

__all__ = [
    "COORDINATOR",
    "MEMBERSHIP",
    "Coordinator",
    "GetCoordinator",
    "GetMembers",
    "Join",
    "Leave",
    "Member",
    "MemberDown",
    "MemberUp",
    "Members",
    "Membership",
]

log = logging.getLogger("dniasync.node")

COORDINATOR = "coordinator"
"""Name of the coordinator actor (on the coordinator node)."""
MEMBERSHIP = "membership"
"""Name of the membership actor on every other node."""


@message("dniasync.cluster.Member")
@dataclass(frozen=True)
class Member:
    node: str
    role: str
    incarnation: str
    alive: bool


@message("dniasync.cluster.Join")
@dataclass(frozen=True)
class Join:
    node: str
    role: str
    incarnation: str
    member: ActorRef
    """The joining node's membership actor: where joins and departures are told."""


@message("dniasync.cluster.Leave")
@dataclass(frozen=True)
class Leave:
    node: str


@message("dniasync.cluster.GetMembers")
@dataclass(frozen=True)
class GetMembers:
    pass


@message("dniasync.cluster.GetCoordinator")
@dataclass(frozen=True)
class GetCoordinator:
    """Ask a node's membership: the node of the coordinator it follows now (``str``; a standby's after a
    takeover)."""


@message("dniasync.cluster.Members")
@dataclass(frozen=True)
class Members:
    members: list[Member]

    def alive(self) -> dict[str, Member]:
        return {m.node: m for m in self.members if m.alive}


@message("dniasync.cluster.MemberUp")
@dataclass(frozen=True)
class MemberUp:
    member: Member


@message("dniasync.cluster.MemberDown")
@dataclass(frozen=True)
class MemberDown:
    node: str
    reason: str


@dataclass(frozen=True)
class _PeerEvent:
    """From the failure detector (local only, never on the wire)."""

    node: str
    up: bool
    reason: str


class Coordinator(Actor):
    """Keeps who is in the cluster, where, with which role, and whether alive."""

    def __init__(self, transport: WebSocketTransport, role: str = "coordinator") -> None:
        self.transport = transport
        self.members: dict[str, Member] = {}
        self.inboxes: dict[str, ActorRef] = {}
        self.own = Member(transport.address, role, transport.incarnation, True)

    async def on_start(self) -> None:
        self.members = {self.own.node: self.own}
        me = self.ref
        self.transport.add_peer_listener(lambda node, up, why: _tell_quietly(me, _PeerEvent(node, up, why)))

    @handler
    def join(self, msg: Join) -> Members:
        member = Member(msg.node, msg.role, msg.incarnation, True)
        known = self.members.get(msg.node)
        self.members[msg.node] = member
        self.inboxes[msg.node] = msg.member
        if known != member:
            log.info("member up: %s (%s)", msg.node, msg.role)
            self._broadcast(MemberUp(member), skip=msg.node)
        return self.snapshot()

    @handler
    def leave(self, msg: Leave) -> None:
        if self.members.pop(msg.node, None) is not None:
            self.inboxes.pop(msg.node, None)
            log.info("member left: %s", msg.node)
            self._broadcast(MemberDown(msg.node, "left"))

    @handler
    def get_members(self, msg: GetMembers) -> Members:
        return self.snapshot()

    @handler
    def peer_event(self, msg: _PeerEvent) -> None:
        member = self.members.get(msg.node)
        if member is None:
            if not msg.up:
                self.transport.forget(msg.node)  # a node that left: stop dialing it
            return
        if not msg.up and member.alive:
            self.members[msg.node] = replace(member, alive=False)
            log.info("member down: %s (%s)", msg.node, msg.reason)
            self._broadcast(MemberDown(msg.node, msg.reason))

    def snapshot(self) -> Members:
        return Members(sorted(self.members.values(), key=lambda m: m.node))

    def _broadcast(self, msg: MemberUp | MemberDown, skip: str = "") -> None:
        for node, inbox in self.inboxes.items():
            if node != skip and self.members.get(node, self.own).alive:
                _tell_quietly(inbox, msg)


def _tell_quietly(ref: ActorRef, msg: object) -> None:
    try:
        ref.tell_nowait(msg)
    except ActorError as exc:
        log.debug("could not tell %s: %s", ref, exc)


class Membership(Actor):
    """A member's view of the cluster; joins through the coordinator, rejoins after it returns."""

    def __init__(self, transport: WebSocketTransport, coordinator: str, role: str) -> None:
        self.transport = transport
        self.coordinator = coordinator
        self.role = role
        self.members: dict[str, Member] = {}
        self.joined = asyncio.Event()

    async def on_start(self) -> None:
        me = self.ref
        self.transport.add_peer_listener(lambda node, up, why: _tell_quietly(me, _PeerEvent(node, up, why)))

    def join_message(self) -> Join:
        return Join(self.transport.address, self.role, self.transport.incarnation, self.ref)

    def coordinator_ref(self) -> ActorRef:
        return self.system.ref(f"{COORDINATOR}@{self.coordinator}")

    @handler
    def members_(self, msg: Members) -> None:
        self.members = {m.node: m for m in msg.members}
        self.joined.set()

    @handler
    def member_up(self, msg: MemberUp) -> None:
        self.members[msg.member.node] = msg.member
        log.info("member up: %s (%s)", msg.member.node, msg.member.role)

    @handler
    def member_down(self, msg: MemberDown) -> None:
        member = self.members.get(msg.node)
        if msg.reason == "left":
            self.members.pop(msg.node, None)
        elif member is not None:
            self.members[msg.node] = replace(member, alive=False)
        log.info("member down: %s (%s)", msg.node, msg.reason)

    @handler
    def get_coordinator(self, msg: GetCoordinator) -> str:
        return self.coordinator

    @handler
    def get_members(self, msg: GetMembers) -> Members:
        return Members(sorted(self.members.values(), key=lambda m: m.node))

    @handler
    async def coordinator_epoch(self, msg: CoordinatorEpoch) -> None:
        """A standby coordinator took the job over: join its table."""
        node = msg.runner.partition("@")[2]
        if node == self.coordinator:
            return
        self.coordinator = node
        try:
            members: Members = await self.coordinator_ref().ask(self.join_message(), timeout=5.0)
        except ActorError as exc:
            log.warning("joining the new coordinator %s failed: %s", node, exc)
            return
        self.members = {m.node: m for m in members.members}

    @handler
    async def peer_event(self, msg: _PeerEvent) -> None:
        if msg.node != self.coordinator_ref().node or not msg.up or not self.joined.is_set():
            return
        try:  # the coordinator is back (perhaps restarted, without its table): join again
            members: Members = await self.coordinator_ref().ask(self.join_message(), timeout=5.0)
        except ActorError as exc:
            log.warning("rejoining via %s failed: %s", self.coordinator, exc)
            return
        self.members = {m.node: m for m in members.members}


async def join_cluster(membership: ActorRef, join: Join, coordinator: ActorRef, stop: asyncio.Event) -> Members:
    """Ask the coordinator to let this node in, retrying with jittered backoff until ``stop``."""
    backoff = Backoff(0.1, 2.0, jitter=0.5)
    while True:
        try:
            members: Members = await coordinator.ask(join, timeout=5.0)
        except ActorError as exc:
            log.info("joining via %s failed (%s); retrying", coordinator.node, exc)
            try:
                async with asyncio.timeout(backoff.failed()):
                    await stop.wait()
            except TimeoutError:
                pass
            if stop.is_set():
                raise
            continue
        await membership.tell(members)
        return members
