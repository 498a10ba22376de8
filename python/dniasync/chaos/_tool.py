"""``python -m dniasync.chaos``: faults on a seeded schedule against a job the local launcher runs."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

__all__ = ["DEFAULT_FAULTS", "FAULTS", "Chaos", "main", "process_resources"]

FAULTS: Final = ("kill_ps", "kill_replica", "freeze", "reset", "blackhole", "delay", "kill_ps_copy",
                  "kill_coordinator")
"""Every fault the tool injects; ``reset``, ``blackhole`` and ``delay`` need the launcher's proxies,
``kill_ps_copy`` a job with replicated PS shards (``ps_replicas >= 2`` in ``[downpour]``, ``[pipeline]`` or
``[sandblaster]``), ``kill_coordinator`` a job
with a standby coordinator (``[job] standby = true``)."""
DEFAULT_FAULTS: Final = FAULTS[:-2]
"""What ``--faults`` defaults to: every fault any Downpour job takes."""
LINK_FAULTS: Final = ("reset", "blackhole", "delay")
RUNNING: Final = ("starting", "waiting", "training")
_TASKS = re.compile(r"^dniasync_node_asyncio_tasks (\S+)$", re.M)


def process_resources(pid: int, metrics_at: str = "") -> dict[str, float] | None:
    """Open fds and RSS of ``pid`` (from /proc), and its asyncio tasks (from ``metrics_at``'s /metrics)."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    doc: dict[str, float] = {"open_fds": fds, "rss_bytes": pages * os.sysconf("SC_PAGE_SIZE")}
    if metrics_at:
        try:
            with urllib.request.urlopen(f"http://{metrics_at}/metrics", timeout=5.0) as resp:
                match = _TASKS.search(resp.read().decode())
            if match:
                doc["asyncio_tasks"] = float(match.group(1))
        except OSError:
            pass
    return doc


@dataclass
class Chaos:
    """One chaos run against the job whose launcher writes ``job_dir/cluster.json``."""

    job_dir: Path
    faults: Sequence[str] = DEFAULT_FAULTS
    seed: int = 0
    first_s: float = 20.0
    every_s: float = 20.0
    count: int | None = None
    freeze_s: float = 10.0
    blackhole_s: float = 5.0
    delay_ms: float = 100.0
    delay_s: float = 10.0
    settle_s: float = 8.0
    wait_s: float = 300.0
    log_path: Path | None = None
    out: IO[str] = sys.stdout
    rng: random.Random = field(init=False)
    injected: list[dict[str, Any]] = field(default_factory=list)
    _frozen: set[int] = field(default_factory=set)
    _round: list[str] = field(default_factory=list)
    _before: dict[str, dict[str, Any]] = field(default_factory=dict)
    _after: dict[str, dict[str, Any]] = field(default_factory=dict)
    _after_at: float = 0.0
    _quiet_from: float = 0.0
    _settled: bool = True

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
        self.rng = random.Random(self.seed)
        self.log_path = self.log_path or self.job_dir / "chaos.jsonl"
        self._t0 = time.monotonic()

    # -- the job ------------------------------------------------------------------
    def cluster(self) -> dict[str, Any]:
        try:
            doc: dict[str, Any] = json.loads((self.job_dir / "cluster.json").read_text())
        except (OSError, ValueError):
            return {}
        return doc

    def running(self) -> bool:
        doc = self.cluster()
        return doc.get("state") in RUNNING and _alive(int(doc.get("launcher_pid", 0)))

    def record(self, kind: str, **details: Any) -> dict[str, Any]:
        entry = {"time": time.time(), "at_s": round(time.monotonic() - self._t0, 3), "kind": kind, **details}
        assert self.log_path is not None
        with self.log_path.open("a") as fh:
            fh.write(json.dumps(entry) + "\n")
        print(json.dumps(entry), file=self.out, flush=True)
        return entry

    def resources(self) -> dict[str, dict[str, Any]]:
        """Resources of the launcher and every child now, by pid."""
        doc = self.cluster()
        out: dict[str, dict[str, Any]] = {}
        launcher = int(doc.get("launcher_pid", 0))
        procs = [("launcher", "launcher", launcher, "")] + [
            (c["role"], c.get("slot", c["role"]), int(c["pid"]), c.get("listen", c["address"]))
            for c in doc.get("children", [])]
        for role, slot, pid, address in procs:
            if pid in self._frozen:
                continue
            found = process_resources(pid, address)
            if found is not None:
                out[str(pid)] = {"role": role, "slot": slot, **found}
        return out

    def _coordinator_logs(self) -> str:
        logs = [c["log"] for c in self.cluster().get("children", []) if c["role"] == "coordinator" and c.get("log")]
        try:
            return "\n".join(Path(path).read_text() for path in logs)
        except OSError:
            return ""

    def ps_copies(self) -> dict[str, tuple[int, int]]:
        """Address -> (shard, copy) of every copy of a replicated PS shard, as the coordinator placed them (empty:
        the job has no replicated shard)."""
        from ..cluster.chains import copies_placed

        return copies_placed(self._coordinator_logs())

    async def check_replicated(self) -> None:
        """Refuse ``kill_ps_copy`` against a job without replicated PS shards (its placements are logged before
        it trains; the log may lag a moment behind ``cluster.json``)."""
        for _ in range(20):
            if self.ps_copies():
                return
            await asyncio.sleep(0.25)
        mode = re.search(r"running job \S+ \((\w+)\)", self._coordinator_logs())
        raise ValueError(f"fault kill_ps_copy needs replicated PS shards (ps_replicas >= 2 in [downpour], [pipeline] "
                         f"or [sandblaster]): the job in {self.job_dir} (mode {mode.group(1) if mode else '?'}) has "
                         "none; leave kill_ps_copy out of --faults (kill_ps kills a PS process)")

    async def check_standby(self) -> None:
        """Refuse ``kill_coordinator`` against a job without a standby coordinator (it would end the job)."""
        for _ in range(20):
            if any(c["role"] == "standby" for c in self.cluster().get("children", [])):
                return
            await asyncio.sleep(0.25)
        raise ValueError(f"fault kill_coordinator needs a standby coordinator ([job] standby = true): the job in "
                         f"{self.job_dir} has none, and its coordinator's death would end it; leave kill_coordinator "
                         "out of --faults")

    # -- faults -------------------------------------------------------------------
    async def inject(self, kind: str) -> dict[str, Any]:
        doc = self.cluster()
        if kind == "kill_coordinator":
            active = [c for c in doc.get("children", []) if c["role"] == "coordinator" and _alive(int(c["pid"]))]
            standing = [c for c in doc.get("children", []) if c["role"] == "standby" and _alive(int(c["pid"]))]
            if not active or not standing:  # the last takeover is still under way: no standby follows yet
                return self.record("skipped", fault=kind, reason="no coordinator with a standby following it")
            os.kill(int(active[0]["pid"]), signal.SIGKILL)
            return self.record(kind, slot=active[0].get("slot"), pid=active[0]["pid"], address=active[0]["address"])
        children = [c for c in doc.get("children", []) if c["role"] != "coordinator" and _alive(int(c["pid"]))]
        if kind == "kill_ps_copy":
            copies = self.ps_copies()
            placed = [(c, copies.get(c["address"]) or copies.get(c.get("listen", ""))) for c in children
                      if c["role"] == "ps" and int(c["pid"]) not in self._frozen]
            running = [(c, where) for c, where in placed if where is not None]
            if not running:
                return self.record("skipped", fault=kind, reason="no running copy of a replicated PS shard")
            child, (shard, copy) = self.rng.choice(running)
            os.kill(int(child["pid"]), signal.SIGKILL)
            return self.record(kind, slot=child.get("slot"), pid=child["pid"], address=child["address"], shard=shard,
                               copy=copy)
        if kind in ("kill_ps", "kill_replica"):
            role = "ps" if kind == "kill_ps" else "worker"
            targets = [c for c in children if c["role"] == role and int(c["pid"]) not in self._frozen]
            if not targets:
                return self.record("skipped", fault=kind, reason=f"no running {role} process")
            child = self.rng.choice(targets)
            os.kill(int(child["pid"]), signal.SIGKILL)
            return self.record(kind, slot=child.get("slot"), pid=child["pid"], address=child["address"])
        if kind == "freeze":
            targets = [c for c in children if int(c["pid"]) not in self._frozen]
            if not targets:
                return self.record("skipped", fault=kind, reason="no running process")
            child = self.rng.choice(targets)
            pid = int(child["pid"])
            os.kill(pid, signal.SIGSTOP)
            self._frozen.add(pid)
            asyncio.get_running_loop().call_later(self.freeze_s, self._thaw, pid)
            return self.record(kind, slot=child.get("slot"), pid=pid, role=child["role"], seconds=self.freeze_s)
        links = sorted(doc.get("chaos", {}).get("links", {}))
        if not links:
            raise RuntimeError(f"fault {kind} needs the launcher's fault proxies: start the job with "
                               "DNIASYNC_CHAOS_PROXY=1 python -m dniasync.node --role local ...")
        link = self.rng.choice(links)
        request: dict[str, Any] = {"fault": kind, "link": link}
        if kind == "blackhole":
            request["seconds"] = self.blackhole_s
        elif kind == "delay":
            request.update(seconds=self.delay_s, delay_ms=self.delay_ms)
        reply = await control(doc["chaos"]["control"], request)
        return self.record(kind, **{k: v for k, v in request.items() if k != "fault"}, reply=reply)

    def _thaw(self, pid: int) -> None:
        self._frozen.discard(pid)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            self.record("thaw", pid=pid, note="the process was gone")
            return
        self.record("thaw", pid=pid)

    def thaw_all(self) -> None:
        for pid in list(self._frozen):
            self._thaw(pid)

    def _next_kind(self) -> str:
        """Faults in rounds, each a seeded shuffle of every kind: n faults in n rounds hit each kind n times."""
        if not self._round:
            self._round = list(self.faults)
            self.rng.shuffle(self._round)
        return self._round.pop()

    def _duration(self, kind: str) -> float:
        return {"freeze": self.freeze_s, "blackhole": self.blackhole_s, "delay": self.delay_s}.get(kind, 0.0)

    # -- the run ------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Wait for training, inject faults on schedule until ``count`` or the job's end; soak; a report."""
        deadline = time.monotonic() + self.wait_s
        while self.cluster().get("state") != "training":
            if time.monotonic() > deadline:
                raise RuntimeError(f"no training job in {self.job_dir} after {self.wait_s:.0f} s "
                                   "(cluster.json state is not 'training')")
            await asyncio.sleep(0.2)
        if "kill_ps_copy" in self.faults:
            await self.check_replicated()
        if "kill_coordinator" in self.faults:
            await self.check_standby()
        self._t0 = time.monotonic()
        self.record("start", seed=self.seed, faults=list(self.faults), every_s=self.every_s, first_s=self.first_s)
        try:
            k = 0
            while self.count is None or k < self.count:
                due = self._t0 + self.first_s + k * self.every_s
                if not await self._sleep_while_running(due - time.monotonic()):
                    break
                if not self._before:
                    self._before = self.resources()
                kind = self._next_kind()
                entry = await self.inject(kind)
                if entry["kind"] != "skipped":
                    self.injected.append(entry)
                self._quiet_from = time.monotonic() + self._duration(kind) + self.settle_s
                self._settled = False
                k += 1
            if self.injected and not self._settled:
                await self._sleep_while_running(self._quiet_from - time.monotonic())
        finally:
            self.thaw_all()
        before, after = self._before, self._after
        soak = {pid: {"before": before[pid], "after": after[pid]} for pid in before if pid in after}
        why = None if soak else soak_unchecked(bool(self.injected), bool(after), self.settle_s)
        self.record("soak", processes=soak, after_s=round(self._after_at - self._t0, 1) if after else None,
                    checked=why is None, **({"why": why} if why else {}))
        return {"faults": self.injected, "soak": soak, "soak_checked": why is None,
                **({"soak_unchecked_why": why} if why else {})}

    async def _sleep_while_running(self, seconds: float) -> bool:
        """Sleep while the job runs (False if it ended); in each quiet moment (``settle_s`` after a fault ended,
        before the next) take the soak's reading of every process, so the last one follows (nearly) every fault."""
        end = time.monotonic() + max(0.0, seconds)
        while True:
            if not self.running():
                return False
            now = time.monotonic()
            if self.injected and not self._settled and now >= self._quiet_from:
                self._after, self._after_at, self._settled = self.resources(), now, True
            if now >= end:
                return True
            await asyncio.sleep(min(0.25, end - now))


def soak_unchecked(injected: bool, read_after: bool, settle_s: float) -> str:
    """Why a run has no soak reading to compare (so its leak check checked nothing)."""
    if not injected:
        return "no fault was injected"
    if not read_after:
        return (f"the job ended before a fault had settled (no reading {settle_s:g} s after one ended, while the "
                "job still ran); lower --settle-s or --every, or give the job longer")
    return "no process was alive both before the first fault and after the last"


async def control(address: str, request: dict[str, Any]) -> dict[str, Any]:
    """Send one request to a launcher's chaos control socket; its reply."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        reply: dict[str, Any] = json.loads(await asyncio.wait_for(reader.readline(), 10.0))
        return reply
    finally:
        writer.close()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dniasync.chaos", description=__doc__)
    p.add_argument("--job-dir", required=True, type=Path, help="the job's output_dir (where cluster.json is)")
    p.add_argument("--faults", default=",".join(DEFAULT_FAULTS),
                   help=f"comma-separated, from {', '.join(FAULTS)} (default: all but kill_ps_copy, which needs "
                        "ps_replicas >= 2 in [downpour], [pipeline] or [sandblaster] (kill_ps then kills a copy too, "
                        "of any shard), and "
                        "kill_coordinator, which needs [job] standby = true)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first", type=float, default=20.0, help="seconds of training before the first fault")
    p.add_argument("--every", type=float, default=20.0, help="seconds between faults")
    p.add_argument("--count", type=int, help="stop after this many faults (default: until the job ends)")
    p.add_argument("--freeze-s", type=float, default=10.0)
    p.add_argument("--blackhole-s", type=float, default=5.0)
    p.add_argument("--delay-ms", type=float, default=100.0)
    p.add_argument("--delay-s", type=float, default=10.0)
    p.add_argument("--settle-s", type=float, default=8.0,
                   help="the soak's reading is taken this long after a fault ended (before the next one)")
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the job to start training")
    p.add_argument("--log", type=Path, help="JSON lines of faults (default <job-dir>/chaos.jsonl)")
    p.add_argument("--report", type=Path, help="write the faults and the soak check here as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        chaos = Chaos(args.job_dir, [f.strip() for f in args.faults.split(",") if f.strip()], seed=args.seed,
                      first_s=args.first, every_s=args.every, count=args.count, freeze_s=args.freeze_s,
                      blackhole_s=args.blackhole_s, delay_ms=args.delay_ms, delay_s=args.delay_s,
                      settle_s=args.settle_s, wait_s=args.wait, log_path=args.log)
        report = asyncio.run(chaos.run())
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    if not report["soak_checked"]:
        print(f"warning: no soak check: {report['soak_unchecked_why']}", file=sys.stderr)
    return 0
