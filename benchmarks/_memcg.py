"""Memory cgroups (v1) for benchmarks: a process in a group of its own, limited, its peak and OOM kills read back.

The mechanism of ``tests/test_data_converted.py``'s memory-limit test: a group made under
``/sys/fs/cgroup/memory``, the child joining it before it execs (``echo $$ > cgroup.procs``), so everything it
maps or allocates, page cache included, is charged to the group; the limit is put on once the child has imported
what it needs (``memory.limit_in_bytes``, and ``memory.memsw.limit_in_bytes`` where swap is accounted), and the
peak (``memory.max_usage_in_bytes``) is counted from then on. Needs root.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

CGROUP = Path("/sys/fs/cgroup/memory")


def unavailable() -> str | None:
    """Why memory groups cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (memory cgroups)"
    if not (CGROUP / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {CGROUP}"
    return None


class MemoryGroup:
    """One memory cgroup, made on entering the ``with`` block; its processes killed and the group removed on leaving."""

    def __init__(self, name: str) -> None:
        self.path = CGROUP / f"{name}-{os.getpid()}"
        self.procs: list[subprocess.Popen[str]] = []

    def __enter__(self) -> MemoryGroup:
        self.path.mkdir()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # an exited process's pages still being uncharged
                time.sleep(0.1)

    def python(self, *args: str) -> subprocess.Popen[str]:
        """``python *args`` in this group (no limit yet), stdin, stdout and stderr piped."""
        join = f'echo $$ > {self.path}/cgroup.procs && exec "$@"'
        proc = subprocess.Popen(["sh", "-c", join, "sh", sys.executable, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def stat(self) -> dict[str, int]:
        lines = (self.path / "memory.stat").read_text().splitlines()
        return {key: int(value) for key, value in (line.split() for line in lines)}

    def usage(self) -> int:
        return int((self.path / "memory.usage_in_bytes").read_text())

    def held(self) -> int:
        """What the group holds besides page cache (anonymous memory, mostly)."""
        return self.usage() - self.stat()["cache"]

    def limit(self, nbytes: int) -> None:
        """Limit the group to ``nbytes`` (swap included, where accounted) and count the peak from now."""
        for knob in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            if (self.path / knob).exists():
                (self.path / knob).write_text(str(nbytes))
        (self.path / "memory.max_usage_in_bytes").write_text("0")

    def peak(self) -> int:
        """The group's largest usage since :meth:`limit`, page cache included."""
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def oom_kills(self) -> int:
        """Processes of the group the kernel's OOM killer ended (0 where the kernel does not count them)."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0
