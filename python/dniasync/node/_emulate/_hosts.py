"""Emulated hosts: network namespaces on one bridge, shaped links, delayed connections, CPU quotas.

:class:`Emulation` makes, for one run id, a hub namespace holding a bridge and one namespace
per host, each joined to the bridge by a veth pair whose two ends are shaped with ``tc tbf``
(the host end limits what the host sends, the hub end what it receives: a machine on a switch),
the delay proxy (``_delay.py``) behind an nftables redirect in every host, and a cpu cgroup per
host with a CFS quota. A process started in a host (:meth:`Emulation.preexec`) joins the host's
cgroup, enters its namespace, and gets a UTS namespace with the host's name (so dniasync sees
another machine and does not take its same-host shared-memory path). The guardian
(``_teardown.py``) is started before anything is made and removes it all when this process
goes, however it goes.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from . import _delay, _teardown

SUBNET = "10.80.0"
"""Every run has a bridge of its own, in namespaces of its own: runs side by side do not collide."""
IFNAME = "eth0"
CONTROL_ADDRESS = f"{SUBNET}.254"
"""The hub's address on the bridge: a process that enters the hub (:meth:`Emulation.enter_control`)
reaches every host from there, over the host's shaped link and through its delay proxy."""
CFS_PERIOD_US = 10_000
"""A short CFS period: a node held to a fifth of a core runs 2 ms in every 10, not 20 in every 100."""
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


class EmulationError(RuntimeError):
    """The emulated hosts cannot be made here."""


def missing() -> str | None:
    """What this machine lacks to emulate hosts, or None."""
    if sys.platform != "linux":
        return "needs Linux (network namespaces, cgroups)"
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, nftables and cgroups are root's): run it with sudo"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"'{tool}' not found: apt-get install -y {package}"
    if _teardown.cpu_hierarchy() is None:
        return "no cgroup hierarchy with the cpu controller is mounted (cgroup v1 'cpu' or v2 with 'cpu')"
    return None


@dataclass(frozen=True)
class Link:
    """What every host's link does: ``rate_bps`` bits/s each way, connections into it ``delay_s`` late."""

    rate_bps: float
    delay_s: float

    def tbf(self) -> list[str]:
        """A token bucket of the rate: a burst of 1 ms at the rate (at least 32 kbit), a 50 ms queue."""
        burst_bits = max(32_000, int(self.rate_bps / 1000))
        return ["tbf", "rate", f"{int(self.rate_bps)}bit", "burst", f"{burst_bits // 8}b", "latency", "50ms"]


def _sh(*args: str, stdin: str | None = None) -> None:
    proc = subprocess.run(list(args), capture_output=True, text=True, input=stdin)
    if proc.returncode != 0:
        raise EmulationError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class Emulation:
    """``hosts`` (short names: letters and digits) on one bridge; see the module doc.

    ``link`` shapes every host's link; ``cpu_share`` is each host's CFS quota in cores. Use as a
    context manager (or :meth:`start` then :meth:`close`); :attr:`rid` names everything made.
    """

    def __init__(self, hosts: Sequence[str], link: Link, cpu_share: float) -> None:
        why = missing()
        if why is not None:
            raise EmulationError(why)
        if not hosts or len(set(hosts)) != len(hosts) or len(hosts) > 250:
            raise ValueError(f"hosts must be 1 to 250 distinct names, got {list(hosts)}")
        self.hosts = list(hosts)
        self.link = link
        self.cpu_share = cpu_share
        self.rid = secrets.token_hex(4)
        self.state = _teardown.STATE_ROOT / self.rid
        self._guardian: subprocess.Popen[bytes] | None = None
        self._proxy: subprocess.Popen[bytes] | None = None
        self._netns_fds: dict[str, int] = {}
        self._home: int | None = None
        self._cgroups: dict[str, Path] = {}

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Emulation:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        _teardown.sweep()  # runs whose launcher and guardian were both killed
        self._start_guardian()
        try:
            self._make_network()
            self._make_cgroups()
            if self.link.delay_s > 0:
                self._start_proxy()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every process of the run and remove everything made; safe to call twice."""
        self.leave_control()
        for fd in self._netns_fds.values():
            os.close(fd)
        self._netns_fds.clear()
        left = _teardown.teardown(self.rid)
        if self._proxy is not None:
            self._proxy.wait()
            self._proxy = None
        if self._guardian is not None:
            assert self._guardian.stdin is not None
            self._guardian.stdin.close()  # the guardian finds nothing left, and exits
            self._guardian.wait()
            self._guardian = None
        if left:
            raise EmulationError("could not remove " + "; ".join(left))

    def _start_guardian(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        self._guardian = subprocess.Popen(
            [sys.executable, "-I", _teardown.__file__, "guard", self.rid],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,  # outlives Ctrl-C at a terminal
        )
        assert self._guardian.stdout is not None
        if self._guardian.stdout.readline().strip() != b"ready":
            raise EmulationError("the guardian process did not start")

    def _make_network(self) -> None:
        hub = self.netns("hub")
        _sh("ip", "netns", "add", hub)
        _sh("ip", "-n", hub, "link", "set", "lo", "up")
        _sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", hub, "addr", "add", f"{CONTROL_ADDRESS}/24", "dev", "br0")
        _sh("ip", "-n", hub, "link", "set", "br0", "up")
        qdisc = self.link.tbf()
        redirect = ("table ip dniasync_emulate {\n  chain prerouting {\n"
                    "    type nat hook prerouting priority dstnat; policy accept;\n"
                    f'    iifname "{IFNAME}" meta l4proto tcp redirect to :{_delay.PORT}\n  }}\n}}\n')
        for i, host in enumerate(self.hosts):
            ns, port = self.netns(host), f"h{i}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", port, "netns", hub)
            _sh("ip", "-n", hub, "link", "set", port, "master", "br0")
            _sh("ip", "-n", hub, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", IFNAME)
            _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", *qdisc)
            _sh("tc", "-n", hub, "qdisc", "add", "dev", port, "root", *qdisc)
            if self.link.delay_s > 0:
                _sh("ip", "netns", "exec", ns, "nft", "-f", "-", stdin=redirect)
        for name in ["hub", *self.hosts]:
            self._netns_fds[name] = os.open(f"/run/netns/{self.netns(name)}", os.O_RDONLY)

    def _make_cgroups(self) -> None:
        found = _teardown.cpu_hierarchy()
        assert found is not None
        root, version = found
        run = root / _teardown.CGROUP_DIR / self.rid
        run.mkdir(parents=True)
        if version == 2:  # the cpu controller must be enabled down to the hosts' parent
            for parent in (root, root / _teardown.CGROUP_DIR, run):
                (parent / "cgroup.subtree_control").write_text("+cpu")
        quota = max(1000, int(self.cpu_share * CFS_PERIOD_US))
        for host in self.hosts:
            group = run / host
            group.mkdir()
            if version == 1:
                (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (group / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
            self._cgroups[host] = group
        self._cgroups[""] = links = run / "links"  # the delay proxy: no quota, but removed with the run
        links.mkdir()

    def _start_proxy(self) -> None:
        self._proxy = subprocess.Popen(
            [sys.executable, "-I", _delay.__file__, repr(self.link.delay_s),
             *(f"{self.netns(h)}={self.address(h)}" for h in self.hosts)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=self._joiner(self._cgroups[""], None, None),
        )
        assert self._proxy.stdout is not None
        if self._proxy.stdout.readline().strip() != b"ready":
            raise EmulationError("the delay proxy did not start")

    # ------------------------------------------------------------------ hosts

    def netns(self, host: str) -> str:
        return _teardown.netns_name(self.rid, host)

    def address(self, host: str) -> str:
        """The host's IPv4 address on the bridge."""
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def cgroup(self, host: str) -> Path:
        return self._cgroups[host]

    def preexec(self, host: str) -> Callable[[], None]:
        """For ``subprocess``'s ``preexec_fn``: the child joins ``host`` (cgroup, network, its own host
        name) and gets SIGTERM if this process dies."""
        return self._joiner(self._cgroups[host], self._netns_fds[host], host)

    def _joiner(self, group: Path, netns_fd: int | None, hostname: str | None) -> Callable[[], None]:
        procs = str(group / "cgroup.procs")
        parent = os.getpid()
        name = hostname.encode() if hostname else b""

        def join() -> None:  # runs in the child between fork and exec: no locks, no imports
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM), "prctl")
            if os.getppid() != parent:  # the launcher died before the line above
                os._exit(1)
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
            if netns_fd is not None:
                _check(_libc.setns(netns_fd, CLONE_NEWNET), "setns")
                _check(_libc.unshare(CLONE_NEWUTS), "unshare")
                _check(_libc.sethostname(name, len(name)), "sethostname")

        return join

    def popen(self, host: str, argv: Sequence[str], *, stdout: int | IO[bytes] | None = None,
              stderr: int | IO[bytes] | None = None, env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen[bytes]:
        """``argv`` on ``host``, in a session of its own (Ctrl-C at a terminal reaches only this process)."""
        return subprocess.Popen(
            list(argv), stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=None if env is None else dict(env),
            cwd=cwd, start_new_session=True, preexec_fn=self.preexec(host),
        )

    def enter_control(self) -> None:
        """Move this thread (and the threads it starts from now on) into the hub, on the bridge at
        :data:`CONTROL_ADDRESS`, so it can reach the hosts; :meth:`leave_control` (and :meth:`close`) goes back."""
        if self._home is None:
            self._home = os.open("/proc/self/ns/net", os.O_RDONLY)
        _check(_libc.setns(self._netns_fds["hub"], CLONE_NEWNET), "setns")

    def leave_control(self) -> None:
        if self._home is not None:
            _check(_libc.setns(self._home, CLONE_NEWNET), "setns")
            os.close(self._home)
            self._home = None

    def tx_bytes(self, host: str) -> int:
        """Bytes ``host`` has sent on its link so far."""
        path = f"/sys/class/net/{IFNAME}/statistics/tx_bytes"
        out = subprocess.run(["ip", "netns", "exec", self.netns(host), "cat", path],
                             capture_output=True, text=True, check=True).stdout
        return int(out)


def wait_gone(rid: str, timeout_s: float = 20.0) -> list[str]:
    """What of run ``rid`` is still there after ``timeout_s`` (its guardian may still be removing it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [*_teardown.run_netns(rid)]
        group = _teardown.run_cgroup(rid)
        if group is not None and group.exists():
            left.append(str(group))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
