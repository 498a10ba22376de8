"""Shared fixtures: real node processes on loopback."""

from __future__ import annotations

import fcntl
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_LISTENING = re.compile(r"listening on (\S+)")


class NodeProcess:
    """A ``python -m dniasync.node`` child: its address, its output, its fate."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dniasync.node", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.address = ""

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_for_line(self, pattern: str, timeout: float = 20.0) -> re.Match[str]:
        """Wait for a stdout line matching ``pattern`` (seen before or arriving)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for line in self.output[seen:]:
                match = regex.search(line)
                if match:
                    return match
            seen = len(self.output)
            left = deadline - time.monotonic()
            if left <= 0 or (self.proc.poll() is not None and self.lines.empty()):
                raise AssertionError(f"node never printed {pattern!r}; stderr:\n{self.stderr()[-3000:]}")
            try:
                self.lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                pass

    def wait_listening(self, timeout: float = 20.0) -> str:
        self.address = self.wait_for_line(_LISTENING.pattern, timeout).group(1)
        return self.address

    def stderr(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit within ``timeout``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.wait()
        self._log.close()
        return code


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """Factory: ``start_node("--role", "worker", ...)`` -> a listening :class:`NodeProcess`.

    Every node started is stopped at teardown.
    """
    started: list[NodeProcess] = []

    def start(*args: str, wait: bool = True) -> NodeProcess:
        node = NodeProcess(list(args), tmp_path / f"node-{len(started)}.log")
        started.append(node)
        if wait:
            node.wait_listening()
        return node

    yield start
    for node in reversed(started):  # members first, so they can still say goodbye to the coordinator
        node.stop()


_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def shared_fork_server() -> Iterator[str]:
    """One shared fork server per test process (``python -m dniasync.node.fork_server``), named to every launch
    the tests start: each ``--role local`` launch then skips importing torch (6-7 s of CPU on a slow core), as
    ``dniasync.compare`` does over its plan. Tests of a launcher's own fork server take the variable out."""
    from dniasync.node.fork_server import SHARED_ENV, running

    with running() as path:
        os.environ[SHARED_ENV] = path
        try:
            yield path
        finally:
            os.environ.pop(SHARED_ENV, None)


@pytest.fixture(scope="session", autouse=True)
def example_data_sets() -> None:
    """Data sets the shipped examples name under ``runs/`` (not in git), made when missing with the commands the
    example's header gives (every ``#   python ...`` line but the job's own launch), as a user makes them.

    Under ``pytest -n`` every worker runs this: a lock on ``runs/`` lets one make the sets while the others wait."""
    (_ROOT / "runs").mkdir(exist_ok=True)
    with open(_ROOT / "runs" / ".example-data.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _make_example_data_sets()


def _make_example_data_sets() -> None:
    for example in sorted((_ROOT / "examples").glob("*.toml")):
        text = example.read_text()
        dataset = str(tomllib.loads(text).get("data", {}).get("dataset", ""))
        if not dataset.startswith("runs/") or (_ROOT / dataset / "manifest.json").is_file():
            continue
        for line in text.splitlines():
            command = line.removeprefix("#").strip()
            if line.startswith("#   python ") and "dniasync.node" not in command:
                done = subprocess.run([sys.executable, *command.split()[1:]], cwd=_ROOT, capture_output=True,
                                      text=True, timeout=300)
                assert done.returncode == 0, f"{example.name}: {command}\n{done.stderr}"
