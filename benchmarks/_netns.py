"""Emulated hosts for benchmarks: network namespaces on one bridge, every link shaped with ``tc tbf``.

``Hosts(n, rate)`` makes a hub namespace holding a bridge and ``n`` host
namespaces, each joined to the bridge by a veth pair whose two ends are both
shaped (``tc qdisc ... root tbf``: the host end limits what the host sends, the
hub end what it receives), so every host has its own link of ``rate`` each way,
like a machine on a switch. Inside a host the link is ``eth0`` at
``addr(i)`` (10.79.0.(i+1)/24). Processes started with :meth:`Hosts.start`
run in the host's namespace and in a UTS namespace of their own whose host
name is the host's (two processes with one host name and boot id would move
dniasync tensors through shared memory, around the link), in a session of their
own, so a Ctrl-C at the terminal reaches only the benchmark, which then stops
them. :meth:`Hosts.close` (also on leaving the ``with`` block, whatever the
exception, Ctrl-C included) stops every process started here, its children
too, and deletes the namespaces, which takes the veth pairs with them.

``tc netem`` is not in every kernel (not in this one): links here have a rate
and a queue, no added delay or loss. Needs root, ``ip`` and ``tc`` (iproute2),
``unshare`` and ``hostname`` (util-linux).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

SUBNET = "10.79.0"
IFNAME = "eth0"
"""The link's name inside every host (gloo and hivemind are told it)."""


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def missing() -> str | None:
    """Why emulated hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found: apt-get install -y iproute2 util-linux"
    return None


def tbf(rate_mbit: float) -> list[str]:
    """A token bucket of ``rate_mbit``: a burst of 1 ms at the rate (at least 32 kbit), a 50 ms queue."""
    burst_kbit = max(32, int(rate_mbit))  # rate * 1 ms, in kbit
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", f"{burst_kbit}kbit", "latency", "50ms"]


class Hosts:
    """``n`` emulated hosts on one bridge, each link shaped to ``rate_mbit`` both ways; see the module doc."""

    def __init__(self, n: int, rate_mbit: float, prefix: str = "dnl") -> None:
        why = missing()
        if why is not None:
            raise RuntimeError(why)
        self.sfx = secrets.token_hex(3)
        self.rate_mbit = rate_mbit
        self.hub = f"{prefix}-{self.sfx}-hub"
        self.names = [f"{prefix}-{self.sfx}-h{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.qdisc = tbf(rate_mbit)
        try:
            self._make()
        except BaseException:
            self.delete()
            raise

    def _make(self) -> None:
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            sh("ip", "netns", "add", ns)
            host_end, hub_end = f"dl{self.sfx}h{i}", f"dl{self.sfx}b{i}"  # at most 15 characters
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", hub_end)
            sh("ip", "link", "set", host_end, "netns", ns)
            sh("ip", "link", "set", hub_end, "netns", self.hub)
            sh("ip", "-n", ns, "link", "set", host_end, "name", IFNAME)
            sh("ip", "-n", self.hub, "link", "set", hub_end, "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", hub_end, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            sh("ip", "-n", ns, "link", "set", IFNAME, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "root", *self.qdisc)
            sh("ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", hub_end, "root", *self.qdisc)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @staticmethod
    def addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def link(self) -> str:
        return f"veth to a bridge per host, tc {' '.join(self.qdisc)} on both ends"

    def start(self, i: int, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """``argv`` in host ``i``'s namespace under the host's name, output to ``log``."""
        with log.open("ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                 f"host{i}", *argv],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env or os.environ),
                cwd=cwd, start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def tx_bytes(self) -> list[int]:
        """Bytes each host has sent on its link so far (the kernel's counter of its ``eth0``)."""
        out = []
        for ns in self.names:
            doc: list[dict[str, Any]] = json.loads(sh("ip", "-n", ns, "-j", "-s", "link", "show", "dev", IFNAME).stdout)
            out.append(int(doc[0]["stats64"]["tx"]["bytes"]))
        return out

    def stop_all(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process started here (and its process group), SIGKILL what is left after ``grace_s``."""
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)  # children the leader left behind (hivemind's p2p daemon)
            if proc.poll() is None:
                proc.wait()
        self.procs.clear()

    def delete(self) -> None:
        for ns in [*self.names, self.hub]:
            sh("ip", "netns", "del", ns, check=False)

    def close(self) -> None:
        """Stop every process, delete every namespace; safe to call twice, and while interrupted."""
        try:
            self.stop_all()
        finally:
            self.delete()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the leader's pid
    except (ProcessLookupError, PermissionError):
        pass


def terminate_as_interrupt() -> None:
    """Make SIGTERM unwind like Ctrl-C, so ``with Hosts(...)`` and ``finally`` blocks clean up on either."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
