"""``--role local``: a whole training cluster on this machine, in one command.

Starts the coordinator, the PS shards and the replicas (or Hogwild workers)
as child processes on loopback, shows a progress bar with live held-out
accuracy and samples/s, prints the summary, and stops every child on exit,
on Ctrl-C and on SIGTERM. Children's logs go to ``<output_dir>/logs/``; their
pids and addresses to ``<output_dir>/cluster.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..actors import ActorError, ActorSystem
from ..cluster.config import Config, ConfigError, load_config
from ..remote import WebSocketTransport
from ..cluster.modes import get_mode
from ..cluster.protocol import COORDINATOR_NAME, JobStatus, JobStatusReply

__all__ = ["run_local"]

_LISTENING = re.compile(r"listening on (\S+)")
STARTUP_TIMEOUT_S = 120.0
PROMETHEUS_TARGETS = "prometheus_targets.json"
"""File-based service discovery targets (every child node) written to the job's output dir."""


RESTART_LIMIT = 3
RESTART_WINDOW_S = 60.0


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


@dataclass
class _Child:
    role: str
    proc: asyncio.subprocess.Process
    log: Path
    address: str = ""


@dataclass
class _Cluster:
    out: Path
    children: list[_Child] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {
            "children": [
                {"role": c.role, "pid": c.proc.pid, "address": c.address, "log": str(c.log)} for c in self.children
            ]
        }

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


async def _spawn(cluster: _Cluster, role: str, index: int, args: list[str], log: Path | None = None) -> _Child:
    logs = cluster.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = log or logs / f"{role}{index}.log"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dniasync.node", "--role", role, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
        env=_child_env(), start_new_session=True,  # Ctrl-C reaches the launcher, which stops the children
        preexec_fn=_end_with_launcher,
    )
    child = _Child(role, proc, log)
    cluster.children.append(child)
    return child


async def _pump(child: _Child, listening: asyncio.Future[str] | None) -> None:
    """Copy a child's output to its log file; resolve ``listening`` with its address."""
    assert child.proc.stdout is not None
    with child.log.open("wb") as fh:
        async for line in child.proc.stdout:
            fh.write(line)
            fh.flush()
            if listening is not None and not listening.done():
                match = _LISTENING.search(line.decode(errors="replace"))
                if match:
                    listening.set_result(match.group(1))
    if listening is not None and not listening.done():
        listening.set_exception(RuntimeError(f"{child.role} exited before listening; see {child.log}"))


def _bar(status: JobStatusReply, width: int = 24) -> str:
    frac = min(1.0, status.epochs / max(status.max_epochs, 1))
    filled = int(frac * width)
    acc = "  -  " if status.accuracy is None else f"{100 * status.accuracy:5.2f}%"
    loss = "  -  " if status.loss is None else f"{status.loss:.3f}"
    alive = sum(1 for s in status.replicas.values() if s == "alive")
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] epoch {status.epochs:5.2f}/{status.max_epochs} "
        f"| held-out acc {acc} | loss {loss} | {status.samples_per_s:7,.0f} samples/s "
        f"| replicas {alive}/{len(status.replicas)} | {status.wall_s:5.1f} s"
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


async def _run(config_path: str, config: Config, out: IO[str], resume: bool) -> int:
    cluster = _Cluster(Path(config.output_dir))
    cluster.out.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pumps: list[asyncio.Task[None]] = []
    interactive = out.isatty()
    try:
        coordinator = await _spawn(cluster, "coordinator", 0, ["--config", config_path, "--listen", "127.0.0.1:0",
                                                               *(["--resume"] if resume else [])])
        listening: asyncio.Future[str] = loop.create_future()
        pumps.append(asyncio.create_task(_pump(coordinator, listening)))
        coordinator.address = await asyncio.wait_for(listening, STARTUP_TIMEOUT_S)
        join = ["--join", coordinator.address]

        def listening_at(child: _Child) -> asyncio.Future[str]:
            def noted(future: asyncio.Future[str]) -> None:
                if not future.cancelled() and future.exception() is None:
                    child.address = future.result()
                    cluster.write_files(config.job.name)

            future: asyncio.Future[str] = loop.create_future()
            future.add_done_callback(noted)
            return future

        mode = get_mode(config.mode)
        n_ps, n_workers = mode.processes(config)
        restarts = _Restarts()
        for i in range(n_ps):
            child = await _spawn(cluster, "ps", i, join)
            pumps.append(asyncio.create_task(_pump(child, listening_at(child))))

        async def restart_ps(child: _Child) -> None:
            """A PS process died: start it again on its address; its shard comes back from the last snapshot."""
            index = cluster.children.index(child)
            print(f"\nPS process {child.address} exited ({child.proc.returncode}); restarting it "
                  f"(see {child.log})", file=out, flush=True)
            n = len(restarts.times.get(child.address, []))
            again = await _spawn(cluster, "ps", index, [*join, "--listen", child.address],
                                 log=child.log.with_name(f"{child.log.stem}.restart{n}.log"))
            again.address = child.address
            cluster.children.remove(again)  # _spawn appended it: it takes the dead one's place instead
            cluster.children[index] = again
            pumps.append(asyncio.create_task(_pump(again, None)))
            cluster.write_files(config.job.name)
        for i in range(n_workers):
            child = await _spawn(cluster, "worker", i, join)
            pumps.append(asyncio.create_task(_pump(child, listening_at(child))))
        cluster.write_files(config.job.name)
        print(f"{config.job.name}: coordinator on {coordinator.address}, {n_ps} PS shard(s), "
              f"{n_workers} {mode.worker_kind}(s); "
              f"logs in {cluster.out / 'logs'}", file=out, flush=True)
        print(f"live page: http://{coordinator.address}/ (Prometheus targets: {cluster.out / PROMETHEUS_TARGETS})",
              file=out, flush=True)
        async with ActorSystem() as system, WebSocketTransport(system, "127.0.0.1:0"):
            trainer = system.ref(f"{COORDINATOR_NAME}@{coordinator.address}")
            status: JobStatusReply | None = None
            last_line = 0.0
            while not stop.is_set():
                if coordinator.proc.returncode is not None:
                    print(f"\nerror: the coordinator exited ({coordinator.proc.returncode}); see {coordinator.log}",
                          file=sys.stderr)
                    return 1
                for child in [c for c in cluster.children if c.role == "ps" and c.proc.returncode is not None]:
                    if not restarts.allow(child.address):
                        print(f"\nerror: PS process {child.address} keeps failing ({RESTART_LIMIT} restarts in "
                              f"{RESTART_WINDOW_S:.0f} s); see {child.log}", file=sys.stderr)
                        return 1
                    await restart_ps(child)
                try:
                    status = await trainer.ask(JobStatus(), timeout=5.0)
                except ActorError:
                    status = None
                if status is not None and status.state != "waiting":
                    line = _bar(status)
                    if interactive:
                        print("\r" + line, end="", file=out, flush=True)
                    elif time.monotonic() - last_line >= 5.0 or status.state == "finished":
                        print(line, file=out, flush=True)
                        last_line = time.monotonic()
                    if status.state in ("finished", "failed"):
                        _summary(config, status, out)
                        return 0 if status.state == "finished" else 1
                try:
                    await asyncio.wait_for(stop.wait(), 0.5)
                except TimeoutError:
                    pass
            print("\ninterrupted: stopping the cluster", file=out, flush=True)
            await cluster.stop()  # the coordinator writes the summary of what ran as it stops
            written = Path(config.output_dir) / "summary.json"
            if written.exists():
                doc = json.loads(written.read_text())
                print(f"  {doc.get('stop_reason')}; {doc.get('samples', 0):,} samples in {doc.get('wall_s', 0):.1f} s",
                      file=out)
                print(f"  summary            {written}", file=out, flush=True)
            return 130
    finally:
        await cluster.stop()
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_local(config_path: str, out: IO[str] = sys.stdout, *, resume: bool = False) -> int:
    """Run the job at ``config_path`` on this machine; the process exit status."""
    from ..runtime import run

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run(_run(config_path, config, out, resume))
