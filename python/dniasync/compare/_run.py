"""Running the plan: each method and seed in its own process, one after another, through the real launcher.

A job runs as ``python -m dniasync.node --role local --config <its file>``; a torch baseline as
``python -m dniasync.compare._baseline``. Each is started in a session of its own (Ctrl-C reaches compare,
which stops the run cleanly: SIGINT, as a user's Ctrl-C would reach the launcher) and dies with compare.
While it runs, the peak RSS (``VmHWM``) of every process it lists in its ``cluster.json`` is read from /proc.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from ._plan import MethodPlan, to_toml

__all__ = ["Interrupted", "Progress", "RunResult", "run_one"]

POLL_S: Final = 0.25
STOP_GRACE_S: Final = 60.0
"""How long a stopped run may take to write its summary before it is killed."""
LOG_TAIL: Final = 8
_ACCURACY = re.compile(r"held-out acc\s+([\d.]+%)")
_SEE = re.compile(r"see (\S+\.log)")


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the running job was stopped; the plan stops."""


@dataclass
class RunResult:
    """One method and seed: its summary, or why there is none."""

    method: str
    seed: int
    status: str
    """``ok``, ``failed``, ``interrupted``, ``timeout``."""
    run_dir: str
    summary: dict[str, Any] | None = None
    error: str | None = None
    peak_rss: dict[str, int] = field(default_factory=dict)
    """Process (``launcher``, ``coordinator0``, ``ps0``, ``worker1``, ``torch``) -> its peak RSS in bytes."""
    process_s: float = 0.0


class Progress:
    """One line on stderr over the whole plan (redrawn in place on a terminal, a line per run otherwise)."""

    def __init__(self, total: int, out: IO[str] = sys.stderr) -> None:
        self.total, self.done, self.out = total, 0, out
        self.started = time.monotonic()
        self.tty = out.isatty()
        self._last = ""
        self._what = ""

    def show(self, what: str, detail: str = "") -> None:
        width = 20
        filled = int(width * self.done / max(self.total, 1))
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} runs | {what}"
                f"{' | ' + detail if detail else ''} | {time.monotonic() - self.started:5.0f} s")
        if self.tty:
            print("\r" + line.ljust(len(self._last)), end="", file=self.out, flush=True)
            self._last = line
        elif what != self._what:  # a log gets a line per run started and finished
            print(line, file=self.out, flush=True)
        self._what = what

    def finish_run(self, result: RunResult) -> None:
        self.done += 1
        note = result.status if result.error is None else f"{result.status}: {result.error.splitlines()[-1][-120:]}"
        self.show(f"{result.method} seed {result.seed} {note}")
        if self.tty:
            print(file=self.out, flush=True)
            self._last = ""


def _die_with_parent() -> None:
    """In the child: SIGTERM if compare dies, even by SIGKILL (no job outlives the comparison)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _peak_rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _processes(run_dir: Path, pid: int, baseline: bool) -> dict[str, int]:
    """Process name -> pid of what the run has started so far."""
    if baseline:
        return {"torch": pid}
    found = {"launcher": pid}
    try:
        doc = json.loads((run_dir / "cluster.json").read_text())
        for child in doc.get("children", []):
            found[str(child.get("slot") or child.get("role"))] = int(child["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return found


def _tail(path: Path, n: int = LOG_TAIL) -> str:
    try:
        lines = [line.rstrip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def run_one(plan: MethodPlan, seed: int, run_dir: Path, *, timeout_s: float, progress: Progress,
            stopping: Callable[[], bool]) -> RunResult:
    """Run ``plan``'s method with job seed ``seed`` in ``run_dir``; raises :class:`Interrupted` after stopping
    it cleanly if ``stopping()`` turns true (the result is then in the exception's args)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "cluster.json"):
        (run_dir / stale).unlink(missing_ok=True)
    config_path = run_dir / "job.toml"
    config_path.write_text(to_toml(plan.for_seed(seed, run_dir)))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if plan.threads is not None:
        threads = str(plan.threads or os.cpu_count() or 1)
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        argv = [sys.executable, "-m", "dniasync.compare._baseline", str(config_path), str(plan.threads)]
    else:
        argv = [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config_path)]
    log = run_dir / "run.log"
    result = RunResult(plan.method, seed, "ok", str(run_dir))
    started = time.monotonic()
    what = f"{plan.method} seed {seed}"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)
        interrupted = timed_out = False
        stop_sent = 0.0
        while proc.poll() is None:
            for name, pid in _processes(run_dir, proc.pid, plan.threads is not None).items():
                rss = _peak_rss(pid)
                if rss is not None:
                    result.peak_rss[name] = max(rss, result.peak_rss.get(name, 0))
            elapsed = time.monotonic() - started
            if not stop_sent and (stopping() or elapsed > timeout_s):
                interrupted, timed_out = stopping(), not stopping()
                proc.send_signal(signal.SIGINT)  # the launcher stops its cluster and writes the summary
                stop_sent = time.monotonic()
            elif stop_sent and time.monotonic() - stop_sent > STOP_GRACE_S:
                os.killpg(proc.pid, signal.SIGKILL)
            match = _ACCURACY.findall(_tail(log, 2))
            progress.show(what, f"{elapsed:5.1f} s" + (f", held-out {match[-1]}" if match else "")
                          + (" (stopping)" if stop_sent else ""))
            time.sleep(POLL_S)
    result.process_s = time.monotonic() - started
    summary = run_dir / "summary.json"
    if summary.exists():
        try:
            result.summary = json.loads(summary.read_text())
        except ValueError as exc:
            result.error = f"unreadable summary.json: {exc}"
    stop_reason = str((result.summary or {}).get("stop_reason") or "")
    if interrupted:
        result.status, result.error = "interrupted", "interrupted by the user"
    elif timed_out:
        result.status, result.error = "timeout", f"still running after {timeout_s:.0f} s: stopped"
    elif proc.returncode != 0 or result.summary is None or stop_reason.startswith(("failed", "stopped")):
        result.status = "failed"
        tail = _tail(log)
        named = _SEE.findall(tail)  # the launcher names the log of the process that failed
        if named and Path(named[-1]).exists():
            tail += f"\n--- {named[-1]}:\n{_tail(Path(named[-1]), 4)}"
        result.error = (f"exit status {proc.returncode}"
                        + (f"; {stop_reason}" if stop_reason else "")
                        + (f"\n{tail}" if tail else ""))
    progress.finish_run(result)
    if interrupted:
        raise Interrupted(result)
    return result
