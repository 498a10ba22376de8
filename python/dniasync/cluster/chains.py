"""Replicated PS shards as the job runner keeps them: each shard's copies, its chain, and the chain's changes.

With ``[downpour] ps_replicas = R > 1`` each PS shard has R copies, each
in a PS process of its own (:class:`~dniasync.train.ps_chain.ChainShard`),
linked into a chain (:mod:`dniasync.train.chain`): replicas push at the head,
which applies and forwards, and the tail acknowledges, so an acknowledged
push is on every live copy. The :class:`ChainKeeper` places the copies (the
first PS processes to join get copy 0 of every shard, the next copy 1, ...),
names each chain once every copy is up (view 1: copies in their order), and
on every tick cuts out a copy whose node the transport declared down (its
connection dropped, or nothing, not even a heartbeat, came from it for the
detection interval): a new view without it goes to the copies left, and the
replicas learn it from them when their next push or pull fails. A copy that
joins again with a new incarnation (the launcher restarted its process) is
added at the tail, and its predecessor sends it its whole state before
forwarding it a push (state transfer while pushes continue). A PS host that
joins when every copy is hosted (a spare: ``--role spare``, or ``--role auto
--spares N``; or a PS process the launcher started again on a new address)
waits; once the chain of a shard has closed around a copy that still does
not answer, the next such host to ask takes that copy's place and joins at
the tail the same way, so the shard is back to R copies without a restart.
A spare's host is named :data:`SPARE_HOST`: the first copies go to the PS
processes, whatever the order they ask in. A shard whose every copy stayed
down for ``lost_after_s`` ends the job; if one comes back (or a spare takes
a copy's place) first, it restarts from the last snapshot, as a shard
without copies does.

The runner's ``ps`` refs are each chain's head (fences and evaluations go
there); :attr:`ChainKeeper.copies` is every copy, which replicas are given.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ..actors import ActorError, ActorRef, Directive
from ..train.chain import ChainView, CopySpec
from ..train.messages import ShardStats
from ..train.specs import ShardSpec
from .mode_api import JobFailed
from .protocol import Assignment, JoinJob, NoJob
from .shards import EVENT_PS_LOST, ShardKeeper

if TYPE_CHECKING:
    from .hosts import Host
    from .report import RunReport

__all__ = [
    "EVENT_PS_CHAIN", "EVENT_PS_COPY_DOWN", "EVENT_PS_COPY_JOINED", "EVENT_PS_COPY_REPLACED", "SPARE_HOST",
    "SPARE_POLL_S", "SPARE_UP_S", "ChainKeeper", "copies_placed", "copy_stats", "host_copy", "record_chains",
]

log = logging.getLogger("dniasync.cluster.chains")

EVENT_PS_COPY_DOWN: Final = "ps_copy_down"
EVENT_PS_COPY_JOINED: Final = "ps_copy_joined"
EVENT_PS_CHAIN: Final = "ps_chain"
EVENT_PS_COPY_REPLACED: Final = "ps_copy_replaced"
SPARE_HOST: Final = "spare-host"
"""The name of the host actor on a spare node: it asks for a copy to host like a PS node's, but takes none of the
first copies (those go to the PS processes), only the place of one whose process is gone."""
SPARE_POLL_S: Final = 1.0
"""How often, at most, a waiting spare asks again: a dead copy is replaced within this of its chain closing."""
SPARE_UP_S: Final = 60.0
"""A spare that took a copy's place and is not up this long after (it died starting) leaves the place to another."""
VIEW_TIMEOUT_S: Final = 70.0
"""How long a copy may take to install a view (the old tail sends a joining copy its state meanwhile)."""
COPY_PLACED: Final = "PS shard %d copy %d (%d parameters) goes to %s"
"""The coordinator's log line for each copy placed (the chaos tool reads it: :func:`copies_placed`)."""
_COPY_PLACED = re.compile(r"PS shard (\d+) copy (\d+) \(\d+ parameters\) goes to (?:\S+@)?(\S+)$", re.M)


def copies_placed(log_text: str) -> dict[str, tuple[int, int]]:
    """Address -> (shard, copy) of every copy of a replicated PS shard a coordinator's log placed (empty: none)."""
    return {m.group(3): (int(m.group(1)), int(m.group(2))) for m in _COPY_PLACED.finditer(log_text)}


@dataclass
class _Copy:
    member: str
    incarnation: int
    ref: ActorRef | None = None
    """The copy's actor (after a restart, the former one's until the new one is up)."""
    up: bool = False
    joining: bool = False
    """Restarted: it joins at the tail once it is up."""
    placed_at: float = 0.0
    """When a spare took this place (0: one of the first copies, or restarted on its own address)."""


class ChainKeeper(ShardKeeper):
    """Where each copy of each PS shard lives, and each shard's chain."""

    def __init__(self, specs: list[ShardSpec], event: Callable[..., None], *, lost_after_s: float,
                 samples: Callable[[], int] = lambda: 0, copies: int = 2) -> None:
        super().__init__(specs, event, lost_after_s=lost_after_s, samples=samples)
        self.n_copies = copies
        self.table: list[list[_Copy | None]] = [[None] * copies for _ in specs]
        self.views: list[ChainView | None] = [None] * len(specs)
        self.changes = 0
        """Views installed after the first ones."""
        self._where: dict[str, tuple[int, int]] = {}
        self._named = False
        self._naming = False
        self._all_down: dict[int, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._locks = [asyncio.Lock() for _ in specs]
        self._last_chain: dict[int, list[ActorRef]] = {}
        """Each shard's chain before every copy was cut out of it at once."""
        self._waiting: set[str] = set()
        """PS hosts told that every copy is hosted, that ask again (spares)."""
        self.replaced = 0
        """Copies whose place another PS host took (their process gone)."""

    @property
    def placed(self) -> bool:
        return self._named

    @property
    def copies(self) -> list[list[ActorRef | None]]:
        """Each shard's copies by copy number (None: never up yet)."""
        return [[c.ref if c is not None else None for c in row] for row in self.table]

    # -- placement --------------------------------------------------------------------
    def place(self, join: JoinJob) -> Assignment | NoJob:
        where = self._where.get(join.member)
        if where is None:
            free = [(k, j) for j in range(self.n_copies) for k in range(len(self.specs)) if self.table[k][j] is None]
            if not free or join.member.partition("@")[0] == SPARE_HOST:
                return self._stand_in(join)
            k, j = free[0]
            self.table[k][j] = _Copy(join.member, join.incarnation)
            self._where[join.member] = (k, j)
            log.info(COPY_PLACED, k, j, self.specs[k].values.size, join.member)
            return Assignment(CopySpec(self.specs[k], j))
        k, j = where
        copy = self.table[k][j]
        assert copy is not None
        if join.incarnation == copy.incarnation:
            return Assignment(CopySpec(self.specs[k], j, copy.joining))  # a retried join: the same answer
        address = copy.ref.address if copy.ref is not None else ""
        copy.incarnation, copy.up = join.incarnation, False
        view = self.views[k]
        if view is not None and any(ref.address == address for ref in view.chain):  # back before it was missed
            self._copy_down(k, address)
            others = [ref for ref in view.chain if ref.address != address]
            if others:
                self._install(k, others, joining=[])
            view = self.views[k]
        if view is not None and view.chain:  # live copies: it catches up from the tail
            copy.joining = True
            log.info("PS shard %d copy %d restarts on %s: it joins the chain at the tail", k, j, join.member)
            return Assignment(CopySpec(self.specs[k], j, True))
        copy.joining = False  # no copy left: it starts from the last snapshot, alone
        return Assignment(CopySpec(self._restart(k, join.member), j))

    def _stand_in(self, join: JoinJob) -> Assignment | NoJob:
        """A PS host beyond the copies: the place of a copy whose process is gone, else wait (asking again)."""
        vacant = self._vacant()
        if vacant is None:
            if join.member not in self._waiting:
                self._waiting.add(join.member)
                log.info("%s waits as a spare: every copy of every PS shard is hosted", join.member)
            return NoJob("every copy of every PS shard is hosted: waiting as a spare", retry=True)
        self._waiting.discard(join.member)
        k, j = vacant
        gone = self.table[k][j]
        assert gone is not None and gone.ref is not None
        del self._where[gone.member]
        view = self.views[k]
        joining = view is not None and bool(view.chain)
        # the former copy's ref stands until the new one is up (replicas assigned meanwhile get every copy)
        self.table[k][j] = _Copy(join.member, join.incarnation, gone.ref, joining=joining,
                                 placed_at=time.monotonic())
        self._where[join.member] = (k, j)
        self.replaced += 1
        log.info(COPY_PLACED, k, j, self.specs[k].values.size, join.member)
        log.warning("PS shard %d copy %d: %s takes the place of the copy at %s, which is gone; it %s", k, j,
                    join.member, gone.ref.address,
                    "joins the chain at the tail" if joining else "restarts the shard from the last snapshot")
        self._event(EVENT_PS_COPY_REPLACED, shard=k, copy=j, address=gone.ref.address, member=join.member)
        if joining:
            return Assignment(CopySpec(self.specs[k], j, True))
        return Assignment(CopySpec(self._restart(k, join.member), j))

    def _vacant(self) -> tuple[int, int] | None:
        """A copy the chain closed around whose process still does not answer, or a spare that took a place and
        never came up (of the shard with the fewest live copies): a spare may take its place. None before the
        chains are named."""
        if not self._named:
            return None
        now = time.monotonic()
        vacant: list[tuple[int, int, int]] = []
        for k, row in enumerate(self.table):
            view = self.views[k]
            chain = {ref.address for ref in view.chain} if view is not None else set()
            for j, copy in enumerate(row):
                if copy is None or copy.ref is None:
                    continue
                gone = copy.up and not copy.ref.is_alive and copy.ref.address not in chain
                if gone or (not copy.up and copy.placed_at and now - copy.placed_at > SPARE_UP_S):
                    vacant.append((len(chain), k, j))
        return min(vacant)[1:] if vacant else None

    def ready(self, member: str, refs: list[ActorRef]) -> bool:
        where = self._where.get(member)
        if where is None:
            return False
        k, j = where
        copy = self.table[k][j]
        assert copy is not None
        if copy.up:
            return True  # a repeated Ready
        copy.ref, copy.up = refs[0], True
        if not self._named:
            if not self._naming and all(c is not None and c.up for row in self.table for c in row):
                self._naming = True
                self._spawn(self._name_chains())
            return True
        view = self.views[k]
        if copy.joining and view is not None and view.chain:
            others = [ref for ref in view.chain if ref.address != copy.ref.address]
            self._install(k, [*others, copy.ref], joining=[copy.ref.address])
            self._event(EVENT_PS_COPY_JOINED, shard=k, copy=j, address=copy.ref.address, member=member)
        else:  # restarted from a snapshot, alone
            self._install(k, [copy.ref], joining=[])
        copy.joining = False
        return True

    async def _name_chains(self) -> None:
        for k, row in enumerate(self.table):
            chain = [c.ref for c in row if c is not None and c.ref is not None]
            await self._deliver(self._set_view(k, chain, []))
        self._named = True
        log.info("all %d PS shards ready, %d copies each", len(self.specs), self.n_copies)

    # -- views ------------------------------------------------------------------------
    def _set_view(self, k: int, chain: list[ActorRef], joining: list[str]) -> ChainView:
        old = self.views[k]
        view = ChainView(k, (old.number if old is not None else 0) + 1, chain, joining)
        self.views[k] = view
        self.refs[k] = chain[0] if chain else None
        return view

    def _install(self, k: int, chain: list[ActorRef], joining: list[str]) -> None:
        view = self._set_view(k, chain, joining)
        self.changes += 1
        self._event(EVENT_PS_CHAIN, shard=k, view=view.number, chain=",".join(ref.address for ref in chain))
        log.warning("PS shard %d: chain view %d is %s", k, view.number, " -> ".join(ref.address for ref in chain))
        self._spawn(self._deliver(view))

    async def _deliver(self, view: ChainView) -> None:
        """Every copy of ``view`` learns it; a joining one first (it refuses pushes until its state arrives)."""
        async def tell(ref: ActorRef) -> None:
            try:
                await ref.ask(view, timeout=VIEW_TIMEOUT_S)
            except ActorError as exc:
                log.warning("PS shard %d: view %d did not reach %s: %r", view.shard, view.number, ref.address, exc)

        async with self._locks[view.shard]:
            joining = [ref for ref in view.chain if ref.address in view.joining]
            for ref in joining:
                await tell(ref)
            await asyncio.gather(*(tell(ref) for ref in view.chain if ref.address not in view.joining))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- liveness ---------------------------------------------------------------------
    def _copy_down(self, k: int, address: str) -> None:
        self._event(EVENT_PS_COPY_DOWN, shard=k, address=address,
                    samples_since_snapshot=self._samples() - self._snapshot_samples.get(k, 0))
        log.warning("PS shard %d: the copy at %s is down; the chain closes around it", k, address)

    def check(self, now: float) -> None:
        for k, view in enumerate(self.views):
            if view is None:
                continue
            live = [ref for ref in view.chain if ref.is_alive]
            if len(live) < len(view.chain):
                for ref in view.chain:
                    if not ref.is_alive:
                        self._copy_down(k, ref.address)
                if live:
                    self._install(k, live, joining=[])
                else:
                    self._last_chain[k] = list(view.chain)  # its order: the head holds every push, the tail less
                    self._set_view(k, [], [])  # no copy left: it comes back from the last snapshot
            if not live and not view.chain:
                # every copy was cut at once (a stalled coordinator misses them all): one that answers again, the
                # same process, heads the chain anew, the first in the last chain's order; the others rejoin
                same = {c.ref.address for c in self.table[k]  # not restarted meanwhile: its state is the chain's
                        if c is not None and c.up and not c.joining and c.ref is not None}
                back = next((ref for ref in self._last_chain.get(k, []) if ref.is_alive and ref.address in same), None)
                if back is not None:
                    log.warning("PS shard %d: the copy at %s answers again: it heads the chain anew", k, back.address)
                    self._install(k, [back], joining=[])
                    live = [back]
            if not live:
                since = self._all_down.setdefault(k, now)
                if now - since >= self._lost_after_s:
                    raise JobFailed(f"every copy of PS shard {k} is down (for {now - since:.0f} s)", EVENT_PS_LOST,
                                    shard=k)
            else:
                self._all_down.pop(k, None)
                self._rejoin(k)

    def _rejoin(self, k: int) -> None:
        """A copy the chain closed around while it could not be reached (its process frozen, its link down) and
        that answers again, the same process: it rejoins at the tail and takes the tail's state, its own being
        behind, as a restarted copy does."""
        for j, copy in enumerate(self.table[k]):
            view = self.views[k]
            if view is None or not view.chain or copy is None or not copy.up or copy.joining or copy.ref is None:
                continue
            ref = copy.ref
            if ref.is_alive and all(r.address != ref.address for r in view.chain):
                log.warning("PS shard %d copy %d at %s answers again: it rejoins the chain at the tail", k, j,
                            ref.address)
                self._install(k, [*view.chain, ref], joining=[ref.address])
                self._event(EVENT_PS_COPY_JOINED, shard=k, copy=j, address=ref.address, member=copy.member)

    # -- status -----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What the job's status carries of the copies (the live page's "PS chains", the chain metrics): ``ps_chains``
        (:meth:`chains`) and ``ps_chain_changes``."""
        return {"ps_chains": self.chains(), "ps_chain_changes": self.changes}

    def chains(self) -> list[dict[str, Any]]:
        """Each shard's chain now, as plain data (it travels in the job's status: the live page, the metrics).

        Per shard: ``shard``, ``view`` (0 until the chain is first named), ``length`` (copies in the chain) and
        ``copies``: those in the chain head to tail, then the others by copy number, each with its ``copy``
        number, the ``address`` of its node and its ``state``: ``live``; ``catching up`` (it joined at the tail
        and takes its predecessor's state while the view is delivered); ``down`` (cut out of the chain, or
        restarting); ``waiting`` (the chain is not named yet).
        """
        delivering = any(not task.done() for task in self._tasks)
        out: list[dict[str, Any]] = []
        for k, row in enumerate(self.table):
            view = self.views[k]
            chain, joining = (view.chain, view.joining) if view is not None else ([], [])
            number = {c.ref.address: j for j, c in enumerate(row) if c is not None and c.ref is not None}
            copies = [{"copy": number.get(ref.address, -1), "address": ref.address.rpartition("@")[2],
                       "state": "catching up" if delivering and ref.address in joining else "live"} for ref in chain]
            inside = {ref.address for ref in chain}
            for j, c in enumerate(row):
                address = "" if c is None else c.ref.address if c.ref is not None else c.member
                if address not in inside:
                    copies.append({"copy": j, "address": address.rpartition("@")[2],
                                   "state": "down" if view is not None else "waiting"})
            out.append({"shard": k, "view": view.number if view is not None else 0, "length": len(chain),
                        "copies": copies})
        return out


async def copy_stats(report: RunReport, k: int, row: Sequence[ActorRef | None], keys: Sequence[str],
                     flag: tuple[str, set[str]]) -> AsyncIterator[tuple[ActorRef, dict[str, Any]]]:
    """Each copy of shard ``k`` (``row``, by copy number) that answers :class:`ShardStats`, with its stats. Into the
    summary, per copy: ``ps<k>_copy<j>_<name>`` (``flag``: a name and the addresses it is 1 for, e.g. the copies in
    the chain), its ``keys`` as integers, or ``..._stats_error`` if it did not answer."""
    name, addresses = flag
    for j, ref in enumerate(row):
        if ref is None:
            continue
        prefix = f"ps{k}_copy{j}"
        report.set_metric(f"{prefix}_{name}", int(ref.address in addresses))
        try:
            stats: dict[str, Any] = await ref.ask(ShardStats(), timeout=5.0)
        except ActorError as exc:
            report.set_metric(f"{prefix}_stats_error", repr(exc))
            continue
        for key in keys:
            report.set_metric(f"{prefix}_{key}", int(stats[key]))
        yield ref, stats


async def record_chains(report: RunReport, keeper: ChainKeeper, acknowledged: Mapping[str, int],
                        shards_of: Mapping[str, Sequence[int]] | None = None) -> None:
    """The summary's figures of replicated shards: each copy's counters (``ps<k>_copy<j>_*``), the chains'
    changes, and ``ps_acknowledged_pushes`` (what the trainers saw acknowledged: ``acknowledged``, by the
    :func:`~dniasync.train.chain.pusher` key each copy counts a trainer's pushes under) against
    ``ps_acknowledged_pushes_kept``: of those, the pushes every live copy holds at the end. Per pusher, the
    fewer of what it saw acknowledged and what each live copy of each shard it pushes to (``shards_of``; None:
    every shard, as a Downpour replica) applied of it: a trainer sends its pushes one at a time, in order, so a
    copy holds a prefix of them. Left out if some shard has no live copy that answers (what it kept is unknown).
    """
    report.set_metric("ps_acknowledged_pushes", sum(acknowledged.values()))
    report.set_metric("ps_chain_changes", keeper.changes)
    report.set_metric("ps_copies_replaced", keeper.replaced)  # by spares (their process gone)
    kept: dict[str, int] | None = dict(acknowledged)
    for k, row in enumerate(keeper.copies):
        view = keeper.views[k]
        chain = {ref.address for ref in view.chain} if view is not None else set()
        holders = 0
        keys = ("applied", "version", "forwarded", "acknowledged", "divergent", "transfers")
        async for ref, stats in copy_stats(report, k, row, keys, ("in_chain", chain)):
            if kept is not None and ref.address in chain and not stats["catching_up"]:
                holders += 1
                applied_by = stats["applied_by"]
                for who, n in kept.items():
                    if shards_of is None or k in shards_of[who]:
                        kept[who] = min(n, int(applied_by.get(who, 0)))
        if not holders:
            kept = None  # no live copy of this shard answered: what it kept is unknown
    if kept is not None:
        report.set_metric("ps_acknowledged_pushes_kept", sum(kept.values()))


async def host_copy(host: Host, spec: CopySpec) -> list[ActorRef]:
    """On a PS node: copy ``spec.copy`` of a replicated shard, a child of ``host``."""
    from ..train.ps_chain import ChainShard

    return [await host.spawn(ChainShard, spec, name=f"ps-{spec.shard.shard}", supervision=Directive.STOP)]
