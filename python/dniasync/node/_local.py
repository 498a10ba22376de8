"""``--role local``: a whole training cluster on this machine, in one command.

Starts the coordinator, the PS shards and the replicas (or Hogwild workers)
as child processes on loopback, shows a progress bar with live held-out
accuracy and samples/s, prints the summary, and stops every child on exit,
on Ctrl-C and on SIGTERM. Children's logs go to ``<output_dir>/logs/``; their
pids and addresses to ``<output_dir>/cluster.json`` (what ``python -m dniasync.chaos`` reads).

The launcher supervises its children: a PS process that dies is started again
on its address (its shard comes back from the last snapshot); a replica's
process that dies, or that the job declared dead while it still runs (frozen,
cut off), is started again on a new address and joins as a new replica; a
pipeline worker's process (with ``[checkpoint] every_seconds``) is started
again and takes the stages of the one that died. At
most :data:`RESTART_LIMIT` restarts of one process in :data:`RESTART_WINDOW_S`;
past that the job fails naming the process and its log. With
``DNIASYNC_CHAOS_PROXY=1`` every PS shard is reached through a fault proxy
(:mod:`dniasync.chaos`) that the chaos tool drives.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Final, Protocol

from ..actors import ActorError, ActorSystem
from ..chaos import PROXY_ENV, ChaosControl
from ..cluster.config import Config, ConfigError, load_config
from ..cluster.modes import get_mode
from ..remote import WebSocketTransport
from ..cluster.protocol import COORDINATOR_NAME, JobStatus, JobStatusReply
from ._zygote import FORK_ENV, SHARED_ENV, ForkedProcess, ForkServer

__all__ = ["Placement", "run_local"]

_LISTENING = re.compile(r"listening on (\S+)")
STATUS_EVERY_S = 0.2
"""How often the launcher asks the coordinator for the job's state (a cheap ask): its progress line, the processes
to restart, and the job's end, which a short job reaches a quarter of a second sooner on average than at 0.5 s."""
PROG = "python -m dniasync.node"
"""The node's command line: how its usage errors (exit 2) start, ``PROG: error: ...``."""
USAGE_PREFIX = f"{PROG}: "
STARTUP_TIMEOUT_S = 120.0
EARLY_JOIN: Final = ["--join", "-"]
"""How the PS and worker processes started beside the coordinator join it: its address on their stdin, once known."""
PROMETHEUS_TARGETS = "prometheus_targets.json"
"""File-based service discovery targets (every child node) written to the job's output dir."""


RESTART_LIMIT = 3
RESTART_WINDOW_S = 60.0


class Placement(Protocol):
    """Where the launcher puts each process instead of loopback (``--emulate``: a host of its own)."""

    token: bytes
    """The cluster token every process is given (their listeners are beyond loopback)."""
    dilation: float
    """Every time the job measures is this many times longer than it would be on the emulated nodes."""

    def args(self, role: str, index: int) -> list[str]:
        """Command-line options for the process (``--listen``, ``--token-file``); the launcher's own come after."""

    def preexec(self, role: str, index: int) -> Callable[[], None]:
        """Run in the child before exec: it enters its host and ends with the launcher."""

    def finish(self, summary: Path) -> list[str]:
        """Called on the job's summary before it is printed; lines to print after it."""


class _Restarts:
    """At most RESTART_LIMIT restarts of one process in RESTART_WINDOW_S; past that the job fails."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def allow(self, key: str) -> bool:
        now = time.monotonic()
        recent = [t for t in self.times.get(key, []) if now - t < RESTART_WINDOW_S]
        if len(recent) >= RESTART_LIMIT:
            return False
        self.times[key] = [*recent, now]
        return True


class ChildExited(RuntimeError):
    """A child process ended before it said where it listens: ``code``, its exit status, and ``lines``, what it
    printed (kept out of its log file when it refused its arguments, exit 2, so a typo overwrites nothing)."""

    def __init__(self, message: str, code: int | None, lines: list[str]) -> None:
        super().__init__(message)
        self.code, self.lines = code, lines


@dataclass
class _Child:
    role: str
    proc: asyncio.subprocess.Process | ForkedProcess
    """Forked by the cluster's fork server, or (an emulated node: its own namespaces and cgroup) started with exec."""
    log: Path
    address: str = ""
    slot: str = ""
    """``ps0``, ``worker1``: what a restarted process replaces; its restarts are counted under it."""
    listen: str = ""
    """The address the process binds when it differs from ``address`` (behind a fault proxy)."""
    held: list[bytes] = field(default_factory=list)
    """What it said while its output is held (see :func:`_pump`)."""
    fh: BinaryIO | None = None
    """Its log file, once open."""

    def open_log(self) -> None:
        """Open the log file (with what was held) if it is not open yet."""
        if self.fh is None:
            self.fh = _open_log(self.log)
            self.fh.writelines(self.held)
            self.fh.flush()


@dataclass
class _Cluster:
    out: Path
    children: list[_Child] = field(default_factory=list)
    state: str = "starting"
    chaos: ChaosControl | None = None
    placement: Placement | None = None
    forks: ForkServer | None = None
    """Forks the processes on loopback (see :mod:`dniasync.node._zygote`); None: each starts with exec."""

    def describe(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "launcher_pid": os.getpid(),
            "state": self.state,
            "children": [
                {"role": c.role, "slot": c.slot, "pid": c.proc.pid, "address": c.address,
                 "listen": c.listen or c.address, "log": str(c.log)} for c in self.children
            ],
        }
        if self.chaos is not None:
            doc["chaos"] = self.chaos.describe()
        return doc

    def write_files(self, job: str) -> None:
        """``cluster.json``, and the Prometheus file-SD targets of every child listening so far."""
        _write_json(self.out / "cluster.json", self.describe())
        targets = [{"targets": [c.address for c in self.children if c.address], "labels": {"cluster": job}}]
        _write_json(self.out / PROMETHEUS_TARGETS, targets)

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child still running, SIGKILL what outlives ``grace_s``."""
        alive = [c for c in self.children if c.proc.returncode is None]
        for child in reversed(alive):
            try:
                child.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        if alive:
            _, pending = await asyncio.wait([asyncio.ensure_future(c.proc.wait()) for c in alive], timeout=grace_s)
            for child in alive:
                if child.proc.returncode is None:
                    child.proc.kill()
                    await child.proc.wait()


def _write_json(path: Path, doc: Any) -> None:
    """Write by rename: tests and Prometheus read these files at any moment, never half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)


def _end_with_launcher() -> None:
    """In the child before exec: SIGTERM it if the launcher dies, even by SIGKILL (nothing is left behind)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _free_address() -> str:
    """A loopback address nobody listens on now (for a process that sits behind a fault proxy)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


async def _spawn(cluster: _Cluster, role: str, index: int, args: list[str], log: Path | None = None,
                 stdin: int = asyncio.subprocess.DEVNULL) -> _Child:
    log = log or cluster.out / "logs" / f"{role}{index}.log"  # made by _pump
    placement = cluster.placement
    if placement is not None:
        args = [*placement.args(role, index), *args]
    proc: asyncio.subprocess.Process | ForkedProcess
    if cluster.forks is not None and placement is None:
        # in a session of its own too, and ended if the launcher dies (see ForkServer)
        proc = await cluster.forks.spawn(["--role", role, *args], _child_env(),
                                         stdin_pipe=stdin == asyncio.subprocess.PIPE)
    else:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dniasync.node", "--role", role, *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, stdin=stdin,
            env=_child_env(), start_new_session=True,  # Ctrl-C reaches the launcher, which stops the children
            preexec_fn=_end_with_launcher if placement is None else placement.preexec(role, index),
        )
    child = _Child(role, proc, log, slot=f"{role}{index}")
    cluster.children.append(child)
    return child


async def _pump(child: _Child, listening: asyncio.Future[str] | None, *, hold: bool = False) -> None:
    """Copy a child's output to its log file; resolve ``listening`` with its address.

    ``hold``: keep the output until the child listens (or :meth:`_Child.open_log`), so one that exits 2 first
    (the coordinator refusing its job config) writes no log file over an earlier run's; the launcher shows what
    it said."""
    assert child.proc.stdout is not None
    if not hold:
        child.open_log()
    try:
        async for line in child.proc.stdout:
            if listening is not None and not listening.done():
                child.held.append(line)  # until it listens: what the launcher shows if it exits first
            if child.fh is not None:
                child.fh.write(line)
                child.fh.flush()
            if listening is not None and not listening.done():
                match = _LISTENING.search(line.decode(errors="replace"))
                if match:
                    child.open_log()
                    listening.set_result(match.group(1))
        if listening is not None and not listening.done():
            code = await child.proc.wait() if hold else child.proc.returncode
            if code != 2 and child.held:  # (one started early that the launcher stopped said nothing)
                child.open_log()
            lines = b"".join(child.held).decode(errors="replace").splitlines()
            listening.set_exception(ChildExited(f"{child.role} exited ({code}) before listening", code, lines))
    finally:
        if child.fh is not None:
            child.fh.close()


def _open_log(path: Path) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("wb")


def _bar(status: JobStatusReply, width: int = 24, dilation: float = 1.0) -> str:
    frac = min(1.0, status.epochs / max(status.max_epochs, 1))
    filled = int(frac * width)
    acc = "  -  " if status.accuracy is None else f"{100 * status.accuracy:5.2f}%"
    loss = "  -  " if status.loss is None else f"{status.loss:.3f}"
    alive = sum(1 for s in status.replicas.values() if s == "alive")
    members = get_mode(status.mode).member_kind + "s"  # the job's own word: replicas, stages
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] epoch {status.epochs:5.2f}/{status.max_epochs} "
        f"| held-out acc {acc} | loss {loss} | {status.samples_per_s * dilation:7,.0f} samples/s "
        f"| {members} {alive}/{len(status.replicas)} | {status.wall_s / dilation:5.1f} s"
    )


def _summary(config: Config, status: JobStatusReply, out: IO[str]) -> None:
    doc: dict[str, Any] = {}
    if status.summary and Path(status.summary).exists():
        doc = json.loads(Path(status.summary).read_text())
    print(f"\njob {config.job.name} ({config.mode}) finished: {doc.get('stop_reason', status.state)}", file=out)
    acc = doc.get("final_accuracy")
    print(f"  held-out accuracy  {acc if acc is None else f'{100 * acc:.2f}%'}"
          f" (best {100 * (doc.get('best_accuracy') or 0):.2f}%)", file=out)
    print(f"  wall time          {doc.get('wall_s', status.wall_s):.1f} s,"
          f" {doc.get('samples', status.samples):,} samples ({doc.get('samples_per_s', 0):,.0f} samples/s)", file=out)
    if doc.get("time_to_target_s") is not None:
        print(f"  time to target     {doc['time_to_target_s']:.1f} s", file=out)
    for line in get_mode(config.mode).summary_lines(config, doc):
        print(line, file=out)
    for event in doc.get("events", []):
        if event.get("kind") != "replica_joined":
            details = ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("kind", "wall_s"))
            print(f"  event at {event['wall_s']:.1f} s: {event['kind']} ({details})", file=out)
    print(f"  summary            {status.summary}", file=out)
    print(f"  plot               {Path(status.summary).with_name('accuracy.png')}", file=out)


class _Supervisor:
    """Starts the job's PS and worker processes, and starts again those that die, each in its slot."""

    def __init__(self, cluster: _Cluster, config: Config, join: list[str], out: IO[str],
                 pumps: list[asyncio.Task[None]]) -> None:
        self.cluster = cluster
        self.config = config
        self.join = join
        self.out = out
        self.pumps = pumps
        self.restarts = _Restarts()
        self.mode = get_mode(config.mode)
        self.restart_workers = self.mode.restarts_workers(config)
        self._restarted: dict[str, int] = {}
        """slot -> restarts so far (each restart logs to a file of its own)."""
        self._seen_alive: set[int] = set()
        """pids of workers whose replica the job has reported alive."""

    def _listening_at(self, child: _Child) -> asyncio.Future[str]:
        def noted(future: asyncio.Future[str]) -> None:
            if not future.cancelled() and future.exception() is None:
                child.address = future.result()
                self.cluster.write_files(self.config.job.name)

        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        future.add_done_callback(noted)
        return future

    async def start(self, role: str, index: int, *, log: Path | None = None,
                    listen: str = "", address: str = "") -> _Child:
        """Start ``role`` number ``index``; a PS behind a fault proxy when the chaos proxies are on."""
        args = list(self.join)
        early = self.join == EARLY_JOIN
        chaos = self.cluster.chaos
        if role == "ps" and chaos is not None:
            listen = listen or _free_address()
            proxy = chaos.proxies.get(f"ps{index}") or await chaos.add(f"ps{index}", listen)
            args += ["--listen", listen, "--advertise", proxy.address]
        elif listen:
            args += ["--listen", listen]
        child = await _spawn(self.cluster, role, index, args, log=log,
                             stdin=asyncio.subprocess.PIPE if early else asyncio.subprocess.DEVNULL)
        child.listen, child.address = listen, address
        self.pumps.append(asyncio.create_task(_pump(child, None if address else self._listening_at(child),
                                                    hold=early)))
        return child

    async def joined(self, coordinator: str) -> None:
        """The coordinator listens at ``coordinator``: those started early (``--join -``) are told, and those
        started from now on join it."""
        self.join = ["--join", coordinator]
        for child in self.cluster.children:
            stdin = child.proc.stdin
            if child.role in ("ps", "worker") and stdin is not None:
                child.open_log()  # the job runs: each process the cluster's files list has its log
                try:
                    stdin.write(f"{coordinator}\n".encode())
                    await stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # it died while starting: check() starts it again, joining coordinator
                finally:
                    stdin.close()

    def give_up(self) -> None:
        """The coordinator never listened: those started early read the end of their input and exit."""
        for child in self.cluster.children:
            if child.role in ("ps", "worker") and child.proc.stdin is not None:
                child.proc.stdin.close()

    async def check(self, status: JobStatusReply | None) -> str | None:
        """Restart what died (and replicas the job declared dead); an error naming a process that keeps failing."""
        if status is not None:
            self._kill_zombies(status)
        for child in list(self.cluster.children):
            if child.role not in ("ps", "worker") or child.proc.returncode is None:
                continue  # a coordinator, a standby or a retired coordinator is not started again here
            if child.role != "ps" and not self.restart_workers:
                continue
            if not self.restarts.allow(child.slot):
                return (f"{child.role} process {child.slot} ({child.address}) keeps failing ({RESTART_LIMIT} restarts "
                        f"in {RESTART_WINDOW_S:.0f} s); see {child.log}")
            await self._restart(child)
        return None

    def _kill_zombies(self, status: JobStatusReply) -> None:
        """A worker whose replica the job declared dead while the process runs (it was frozen or cut off) is
        fenced for good: end it, so that it is started again as a new replica instead of training for nothing.
        The same for a pipeline worker whose stages the job gave to the next worker to join."""
        for child in self.cluster.children:
            if child.role != "worker" or not child.address or child.proc.returncode is not None:
                continue
            state = self.mode.worker_state(status.replicas, child.address)
            if state == "alive":
                self._seen_alive.add(child.proc.pid)
            elif state == "dead" and child.proc.pid in self._seen_alive and self.restart_workers:
                print(f"\n{self.mode.member_kind}(s) of worker {child.slot} "
                      f"({child.address}) declared dead while its process runs; "
                      f"restarting it (see {child.log})", file=self.out, flush=True)
                child.proc.kill()

    async def _restart(self, child: _Child) -> None:
        index = self.cluster.children.index(child)
        print(f"\n{child.role} process {child.slot} ({child.address}) exited ({child.proc.returncode}); restarting it "
              f"(see {child.log})", file=self.out, flush=True)
        self._restarted[child.slot] = n = self._restarted.get(child.slot, 0) + 1
        log = self.cluster.out / "logs" / f"{child.slot}.restart{n}.log"
        slot = int(child.slot.removeprefix(child.role))
        if child.role == "ps":  # on its address: the replicas' refs to the shard stay valid
            again = await self.start("ps", slot, log=log, listen=child.listen or child.address, address=child.address)
        else:  # on a new address: a new replica (the old one is fenced on the PS shards)
            again = await self.start(child.role, slot, log=log)
        self.cluster.children.remove(again)  # _spawn appended it: it takes the dead one's place instead
        self.cluster.children[index] = again
        self.cluster.write_files(self.config.job.name)


class _Standbys:
    """``[job] standby``: a standby coordinator process beside the active one; when the active one dies, the
    standby (which noticed by itself) is the coordinator, and a new standby follows it."""

    def __init__(self, cluster: _Cluster, config_path: str, pumps: list[asyncio.Task[None]]) -> None:
        self.cluster = cluster
        self.config_path = config_path
        self.pumps = pumps
        self.current: _Child | None = None
        self.started = 0

    async def start(self, active: str) -> None:
        """A standby following the coordinator at ``active``; returns once it listens."""
        listen = ["--listen", "127.0.0.1:0"] if self.cluster.placement is None else []
        child = await _spawn(self.cluster, "standby", self.started,
                             ["--config", self.config_path, "--join", active, *listen])
        self.started += 1
        listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.pumps.append(asyncio.create_task(_pump(child, listening)))
        child.address = await asyncio.wait_for(listening, STARTUP_TIMEOUT_S)
        self.current = child

    def exited(self) -> bool:
        """The standby process itself ended (it is started again)."""
        return self.current is not None and self.current.proc.returncode is not None

    async def took_over(self, system: ActorSystem) -> bool:
        """Whether the standby runs the job now (it took it over from a coordinator silent too long)."""
        if self.current is None or self.current.proc.returncode is not None:
            return False
        try:
            await system.ref(f"{COORDINATOR_NAME}@{self.current.address}").ask(JobStatus(), timeout=2.0)
        except ActorError:
            return False
        return True

    async def promote(self, old: _Child, out: IO[str]) -> _Child:
        """The standby took the job over from ``old`` (dead, or silent too long): it is the coordinator now, and a
        new standby follows it. ``old``, if it wakes, finds itself fenced."""
        active = self.current
        assert active is not None
        code = old.proc.returncode
        why = f"exited ({code})" if code is not None else "stopped answering"
        print(f"\nthe coordinator {why}; the standby at {active.address} took the job over (see {active.log})",
              file=out, flush=True)
        old.role, active.role = "retired", "coordinator"
        self.current = None
        await self.start(active.address)
        return active


async def _run(config_path: str, config: Config, out: IO[str], resume: bool, placement: Placement | None) -> int:
    cluster = _Cluster(Path(config.output_dir), placement=placement)
    dilation = 1.0 if placement is None else placement.dilation
    made_out, refused = not cluster.out.exists(), False
    cluster.out.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pumps: list[asyncio.Task[None]] = []
    interactive = out.isatty()
    try:
        if os.environ.get(PROXY_ENV, "") not in ("", "0"):
            cluster.chaos = ChaosControl()
            await cluster.chaos.start()
        if placement is None and os.environ.get(FORK_ENV, "1") != "0":
            # torch and the rest imported once, not by each process: ~3 s of CPU saved per process that trains
            preload = get_mode(config.mode).preload(config)
            shared = os.environ.get(SHARED_ENV, "")
            if shared:  # a shared server's imports are done already (dniasync.node.fork_server)
                cluster.forks = await ForkServer.connect(shared, preload)
                if cluster.forks is None:
                    print(f"note: no fork server answered on {SHARED_ENV}={shared}: this job starts its own",
                          file=out, flush=True)
            if cluster.forks is None:
                cluster.forks = await ForkServer.start(_child_env(), preload)
        listen = ["--listen", "127.0.0.1:0"] if placement is None else []  # a placement says where
        coordinator = await _spawn(cluster, "coordinator", 0, ["--config", config_path, *listen,
                                                               *(["--resume"] if resume else [])])
        listening: asyncio.Future[str] = loop.create_future()
        pumps.append(asyncio.create_task(_pump(coordinator, listening, hold=True)))
        mode = get_mode(config.mode)
        n_ps, n_workers = mode.processes(config)
        # on loopback the PS and worker processes start now, beside the coordinator (each import of torch takes
        # seconds: the coordinator's, checking the job, and a worker's overlap), and read its address once it listens
        supervisor = _Supervisor(cluster, config, EARLY_JOIN if placement is None else [], out, pumps)
        if placement is None:
            for i in range(n_ps):
                await supervisor.start("ps", i)
            for i in range(n_workers):
                await supervisor.start("worker", i)
        try:
            coordinator.address = await asyncio.wait_for(listening, STARTUP_TIMEOUT_S)
        except ChildExited as exited:  # its own error (a --resume with no checkpoint, a bad key) is the one to show
            supervisor.give_up()
            code, lines = exited.code, [line for line in exited.lines if line.strip()]
            # its own "error: ..." lines, or the command line's (a job config it refuses, naming the key)
            said = [line.removeprefix(USAGE_PREFIX) for line in lines if line.startswith(("error:", USAGE_PREFIX))]
            last = f": {lines[-1].strip()}" if lines else ""  # a traceback's last line names the exception
            print("\n".join(said[-3:]) or f"error: the coordinator exited ({code}) before it listened{last}",
                  file=sys.stderr)
            if code == 2:  # a refused config leaves nothing behind, nor overwrites an earlier run's files
                refused = True
                return 2
            print(f"  see {coordinator.log}", file=sys.stderr)
            return 1

        standbys = _Standbys(cluster, config_path, pumps) if config.job.standby else None
        if standbys is not None:
            await standbys.start(coordinator.address)
        if placement is None:
            await supervisor.joined(coordinator.address)
        else:
            supervisor.join = ["--join", coordinator.address]
            for i in range(n_ps):
                await supervisor.start("ps", i)
            for i in range(n_workers):
                await supervisor.start("worker", i)
        cluster.write_files(config.job.name)
        print(f"{config.job.name}: coordinator on {coordinator.address}, {n_ps} PS shard(s), "
              f"{n_workers} {mode.worker_kind}(s); "
              f"logs in {cluster.out / 'logs'}", file=out, flush=True)
        print(f"live page: http://{coordinator.address}/ (Prometheus targets: {cluster.out / PROMETHEUS_TARGETS})",
              file=out, flush=True)
        token = None if placement is None else placement.token
        async with ActorSystem() as system, WebSocketTransport(system, "127.0.0.1:0", token=token):
            trainer = system.ref(f"{COORDINATOR_NAME}@{coordinator.address}")
            status: JobStatusReply | None = None
            last_line = 0.0
            while not stop.is_set():
                if coordinator.proc.returncode is not None and (standbys is None or standbys.current is None):
                    print(f"\nerror: the coordinator exited ({coordinator.proc.returncode}); see {coordinator.log}",
                          file=sys.stderr)
                    return 1
                try:
                    status = await trainer.ask(JobStatus(), timeout=5.0)
                except ActorError:
                    status = None
                if status is not None and status.state == "fenced":
                    status = None  # a coordinator a standby took the job over from (it woke up): ask the standby
                if status is None and standbys is not None and await standbys.took_over(system):
                    coordinator = await standbys.promote(coordinator, out)
                    trainer = system.ref(f"{COORDINATOR_NAME}@{coordinator.address}")
                    supervisor.join = ["--join", coordinator.address]  # processes started from now on
                    cluster.write_files(config.job.name)
                    continue
                if standbys is not None and standbys.exited():
                    await standbys.start(coordinator.address)
                if status is None or status.state not in ("finished", "failed"):
                    failing = await supervisor.check(status)
                    if failing is not None:
                        print(f"\nerror: {failing}", file=sys.stderr)
                        cluster.state = "failed"
                        return 1
                if status is not None and status.state != cluster.state:
                    cluster.state = status.state
                    cluster.write_files(config.job.name)
                if status is not None and status.state != "waiting":
                    line = _bar(status, dilation=dilation)
                    if interactive:
                        print("\r" + line, end="", file=out, flush=True)
                    elif time.monotonic() - last_line >= 5.0 or status.state == "finished":
                        print(line, file=out, flush=True)
                        last_line = time.monotonic()
                    if status.state in ("finished", "failed"):
                        notes = [] if placement is None or not status.summary else placement.finish(Path(status.summary))
                        _summary(config, status, out)
                        for note in notes:
                            print(note, file=out)
                        return 0 if status.state == "finished" else 1
                try:  # the job's state this often: a job that ended is seen within STATUS_EVERY_S
                    await asyncio.wait_for(stop.wait(), STATUS_EVERY_S)
                except TimeoutError:
                    pass
            print("\ninterrupted: stopping the cluster", file=out, flush=True)
            cluster.state = "stopping"
            cluster.write_files(config.job.name)
            await cluster.stop()  # the coordinator writes the summary of what ran as it stops
            written = Path(config.output_dir) / "summary.json"
            if written.exists():
                if placement is not None:
                    placement.finish(written)
                doc = json.loads(written.read_text())
                print(f"  {doc.get('stop_reason')}; {doc.get('samples', 0):,} samples in {doc.get('wall_s', 0):.1f} s",
                      file=out)
                print(f"  summary            {written}", file=out, flush=True)
            return 130
    finally:
        if cluster.state not in ("finished", "failed"):
            cluster.state = "stopped"
        if not refused:
            cluster.write_files(config.job.name)
        await cluster.stop()
        if cluster.forks is not None:
            await cluster.forks.close()
        if cluster.chaos is not None:
            await cluster.chaos.close()
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if refused and made_out:
            shutil.rmtree(cluster.out, ignore_errors=True)


def run_local(config_path: str, out: IO[str] = sys.stdout, *, resume: bool = False,
              placement: Placement | None = None) -> int:
    """Run the job at ``config_path`` on this machine (each process where ``placement`` says, by
    default on loopback); the process exit status."""
    from ..runtime import run

    try:
        # the rules against the model and the data (which import torch: 2 s of start-up) are checked by the
        # coordinator as it starts; its error, naming the key, is the launcher's (see _run)
        config = load_config(config_path, resolve=False)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run(_run(config_path, config, out, resume, placement))
