"""Everything an emulated run made, found by its run id and removed; the guardian that does it.

Standard library only: the launcher runs this file as a script (``python _teardown.py guard RID``)
before it makes anything, so the guardian starts in a fraction of a second and imports nothing
that could fail. The guardian holds the read end of a pipe whose write end only the launcher
holds; when the pipe closes (the launcher exited, however: normally, by an exception or by
SIGKILL) it removes the run: every process in the run's cgroups is killed, the cgroups are
removed, every process still in the run's network namespaces is killed and the namespaces are
deleted (their veth pairs, bridge, qdiscs and nftables rules go with them).

Names are keyed by the run id, so :func:`teardown` needs no record of what was made:
namespaces ``dne-<rid>-<host>``, cgroups ``<cpu hierarchy>/dniasync-emulate/<rid>/<host>``,
state (the cluster token, the guardian's pid) in ``/run/dniasync-emulate/<rid>``.
:func:`sweep` removes the runs whose guardian is gone (it was killed too).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

NETNS_PREFIX = "dne-"
CGROUP_DIR = "dniasync-emulate"
STATE_ROOT = Path("/run/dniasync-emulate")
NETNS_DIR = Path("/run/netns")


def is_rid(text: str) -> bool:
    """Whether ``text`` is a run id (8 hex digits): a cgroup directory also holds the controller's files."""
    return len(text) == 8 and all(c in "0123456789abcdef" for c in text)


def netns_name(rid: str, host: str) -> str:
    return f"{NETNS_PREFIX}{rid}-{host}"


def cpu_hierarchy() -> tuple[Path, int] | None:
    """Where the ``cpu`` controller is mounted and the cgroup version (1 or 2); None without one."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    v2: Path | None = None
    for line in mounts:
        fields = line.split()
        if len(fields) < 4:
            continue
        where, kind, options = Path(fields[1]), fields[2], fields[3].split(",")
        if kind == "cgroup" and "cpu" in options:
            return where, 1
        if kind == "cgroup2" and v2 is None:
            try:
                if "cpu" in (where / "cgroup.controllers").read_text().split():
                    v2 = where
            except OSError:
                pass
    return (v2, 2) if v2 is not None else None


def run_cgroup(rid: str) -> Path | None:
    found = cpu_hierarchy()
    return None if found is None else found[0] / CGROUP_DIR / rid


def run_netns(rid: str) -> list[str]:
    """The run's namespaces that still have a name."""
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(netns_name(rid, "")))


def _pids(procs: Path) -> list[int]:
    try:
        return [int(p) for p in procs.read_text().split()]
    except (OSError, ValueError):
        return []


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _empty_cgroup(group: Path, deadline: float) -> None:
    """Kill every process in ``group`` until none is left (a process may fork while it is killed)."""
    kill_file = group / "cgroup.kill"  # cgroup v2: kills the whole subtree atomically
    while time.monotonic() < deadline:
        pids = _pids(group / "cgroup.procs")
        if not pids:
            return
        if kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError:
                _kill(pids)
        else:
            _kill(pids)
        time.sleep(0.05)


def teardown(rid: str, timeout_s: float = 20.0) -> list[str]:
    """Remove everything of run ``rid``; what could not be removed (empty when all went)."""
    deadline = time.monotonic() + timeout_s
    left: list[str] = []
    root = run_cgroup(rid)
    if root is not None and root.exists():
        groups = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for group in [*groups, root]:
            _empty_cgroup(group, deadline)
        for group in [*groups, root]:
            while True:
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        left.append(f"cgroup {group}: {exc.strerror}")
                        break
                    time.sleep(0.05)
    for name in run_netns(rid):
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        _kill([int(p) for p in pids if p.isdigit()])
        proc = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
        if proc.returncode != 0 and (NETNS_DIR / name).exists():
            left.append(f"netns {name}: {proc.stderr.strip()}")
    shutil.rmtree(STATE_ROOT / rid, ignore_errors=True)
    return left


def guardian_alive(rid: str) -> bool:
    """Whether run ``rid``'s guardian still runs (its pid file names a process that names the run)."""
    try:
        pid = int((STATE_ROOT / rid / "guardian.pid").read_text())
        return rid in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return False


def sweep() -> list[str]:
    """Tear down every run whose guardian is gone; the run ids removed."""
    rids: set[str] = set()
    try:
        rids.update(os.listdir(STATE_ROOT))
    except OSError:
        pass
    try:
        rids.update(n[len(NETNS_PREFIX):].split("-")[0] for n in os.listdir(NETNS_DIR) if n.startswith(NETNS_PREFIX))
    except OSError:
        pass
    found = cpu_hierarchy()
    if found is not None:
        try:
            rids.update(os.listdir(found[0] / CGROUP_DIR))
        except OSError:
            pass
    swept = [rid for rid in sorted(rids) if is_rid(rid) and not guardian_alive(rid)]
    for rid in swept:
        teardown(rid)
    return swept


def guard(rid: str) -> int:
    """Wait for standard input to close (the launcher is gone), then remove run ``rid``."""
    state = STATE_ROOT / rid
    state.mkdir(parents=True, exist_ok=True)
    (state / "guardian.pid").write_text(str(os.getpid()))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the launcher, which then closes the pipe

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except SystemExit:
        pass
    finally:
        teardown(rid)
        time.sleep(0.5)  # an `ip` the launcher started just before it died may have finished since
        left = teardown(rid)
        for what in left:
            print(f"dniasync emulate: could not remove {what}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "guard":
        sys.exit(guard(sys.argv[2]))
    if len(sys.argv) == 3 and sys.argv[1] == "teardown":
        sys.exit(1 if teardown(sys.argv[2]) else 0)
    if len(sys.argv) == 2 and sys.argv[1] == "sweep":
        print("\n".join(sweep()))
        sys.exit(0)
    print("usage: _teardown.py guard RID | teardown RID | sweep", file=sys.stderr)
    sys.exit(2)
