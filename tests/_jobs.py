"""Run a job the way a user does: a TOML file, ``python -m dniasync.node --role local``, its ``summary.json``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def write_job(tmp_path: Path, name: str, template: str, **fields: Any) -> tuple[Path, Path]:
    """``template`` filled with ``name``, ``out`` (the job's output_dir) and ``fields``: (config path, output dir)."""
    out = tmp_path / name
    config = tmp_path / f"{name}.toml"
    config.write_text(template.format(name=name, out=out, **fields))
    return config, out


def _command(config: Path) -> list[str]:
    return [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)]


def launch(config: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The local launcher on ``config``, to the end."""
    return subprocess.run(_command(config), capture_output=True, text=True, timeout=timeout)


def summary(out: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return doc


def run_job(tmp_path: Path, name: str, template: str, *, timeout: float = 400,
            **fields: Any) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Write, launch, check it exited 0; (its summary, the launcher's process)."""
    config, out = write_job(tmp_path, name, template, **fields)
    proc = launch(config, timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return summary(out), proc


def launch_two_at_a_time(configs: dict[str, Path], *,
                         timeout: float = 600) -> dict[str, subprocess.CompletedProcess[str]]:
    """The local launcher on each of ``configs`` (``{name: config}``), two running at once: ``{name: its process}``,
    exit codes unchecked (each test checks its own job's, so one failed job fails only its tests).

    For the jobs of a module that stop at a count (epochs, iterations, a target), not at a time: a short job's wall
    time is mostly start-up (imports, spawns, joins), one process at a time, which leaves a core idle; two jobs fill
    it. Not more: on a 2-core machine a third only slows the other two.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        started = {name: pool.submit(launch, config, timeout) for name, config in configs.items()}
        return {name: future.result() for name, future in started.items()}


def run_jobs_together(tmp_path: Path, template: str, jobs: dict[str, dict[str, Any]], *,
                      timeout: float = 400) -> dict[str, dict[str, Any]]:
    """Several jobs launched at once (``{name: fields}``), each checked to exit 0: ``{name: summary}``.

    For jobs whose results do not depend on when they run (a stop by epochs or target, not by seconds): their
    start-ups (imports, spawns, joins: most of a short job's wall time) overlap.
    """
    started = {}
    for name, fields in jobs.items():
        config, out = write_job(tmp_path, name, template, **fields)
        started[name] = (out, subprocess.Popen(_command(config), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               text=True))
    try:
        for name, (_, proc) in started.items():
            output, _ = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"{name}: {output}"
    finally:
        for _, proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {name: summary(out) for name, (out, _) in started.items()}


def trained_log(log: Path, timeout: float = 120) -> str:
    """The text of a coordinator's ``log`` once it has evaluated trained weights (an ``eval:`` line past 0 samples)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            text = log.read_text()
            if any("eval:" in line and " 0 samples" not in line for line in text.splitlines()):
                return text
        time.sleep(0.1)
    raise AssertionError(f"{log}: the job never trained")


def node(role: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
    """One node process started by hand, as on separate machines (nobody restarts it), its output to ``log``."""
    with log.open("wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", role, *args],
                                stdout=fh, stderr=subprocess.STDOUT)


def listening(log: Path, timeout: float = 120) -> str:
    """The address a node started by :func:`node` says it listens on, once its ``log`` says so."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if " listening on " in line:
                return line.rsplit(" ", 1)[1]
        time.sleep(0.1)
    raise AssertionError(f"{log.name}: the node never listened:\n{log.read_text()}")
