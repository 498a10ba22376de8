"""``--role local --emulate``: a job on emulated nodes, their CPU quota and links measured, nothing left after.

The emulated parts need root, iproute2, nftables and the cpu cgroup controller; those tests skip
naming what is missing. The checks on timing are measurements with wide margins (the machine is
shared): a quota caps what a busy loop gets, a shaped link cannot carry a transfer faster than its
rate, and the delay proxy cannot answer a ping sooner than twice its delay; the upper bounds are loose.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dniasync.node._emulate import Emulation, Link, missing, wait_gone

MISSING = missing()
needs_emulation = pytest.mark.skipif(MISSING is not None, reason=f"emulated nodes: {MISSING}")

JOB = """
[job]
name = "{name}"
mode = "downpour"
seed = 3
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"

[model.kwargs]
sizes = [64, 64, 10]

[data]
dataset = "digits"
n_train = 1400
n_test = 397
batch_size = 32

[optimizer]
name = "adagrad"
lr = 0.05

[downpour]
n_replicas = {replicas}
n_ps_shards = 1

[stop]
max_epochs = {epochs}
max_seconds = 600

[eval]
every_seconds = 1.0
"""

BUSY = """
import time
start, cpu = time.perf_counter(), time.process_time()
while time.perf_counter() - start < {seconds}:
    pass
print((time.process_time() - cpu) / (time.perf_counter() - start), flush=True)
"""

SERVER = r"""
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 5000))
s.listen()
print("up", flush=True)
c, _ = s.accept()
while True:
    kind = c.recv(1)
    if not kind:
        break
    if kind == b"p":
        c.sendall(b"p")
        continue
    n, got = int.from_bytes(c.recv(8, socket.MSG_WAITALL), "big"), 0
    while got < n:
        got += len(c.recv(1 << 20))
    c.sendall(b"k")
"""

CLIENT = r"""
import json, socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 5000))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
pings = []
for _ in range(10):
    t = time.perf_counter(); c.sendall(b"p"); c.recv(1); pings.append(time.perf_counter() - t)
n = int(sys.argv[2])
t = time.perf_counter(); c.sendall(b"d" + n.to_bytes(8, "big") + b"x" * n); c.recv(1)
print(json.dumps({"rtt_s": statistics.median(pings), "transfer_s": time.perf_counter() - t}))
"""


def _node(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dniasync.node", *args], capture_output=True, text=True, timeout=120)


def _job(tmp_path: Path, name: str, *, replicas: int = 2, epochs: int = 2) -> tuple[Path, Path]:
    out = tmp_path / name
    config = tmp_path / f"{name}.toml"
    config.write_text(JOB.format(name=name, out=out, replicas=replicas, epochs=epochs))
    return config, out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _processes_naming(rid: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if rid in cmdline and _alive(int(entry.name)):
                found.append(f"{entry.name}: {cmdline}")
    return found


def _assert_nothing_left(rid: str, cluster: dict[str, Any]) -> None:
    assert wait_gone(rid, timeout_s=30) == []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
            any(_alive(c["pid"]) for c in cluster["children"]) or _processes_naming(rid)):
        time.sleep(0.2)
    assert [c for c in cluster["children"] if _alive(c["pid"])] == []
    assert _processes_naming(rid) == []  # the guardian and the delay proxy too
    assert not (Path("/run/dniasync-emulate") / rid).exists()


@pytest.mark.parametrize("args, says", [
    (["--emulate", "0"], "NODES must be 1 to 64"),
    (["--emulate", "2:fast"], "BANDWIDTH"),
    (["--emulate", "2:1gbit:5"], "LATENCY"),
    (["--emulate", "2:1gbit:5ms:x"], "NODES[:BANDWIDTH[:LATENCY]]"),
])
def test_a_bad_spec_exits_2_naming_the_flag(tmp_path: Path, args: list[str], says: str) -> None:
    config, _ = _job(tmp_path, "bad")
    proc = _node("--role", "local", "--config", str(config), *args)
    assert proc.returncode == 2, proc.stderr
    assert "--emulate" in proc.stderr and says in proc.stderr


def test_emulate_needs_role_local() -> None:
    proc = _node("--role", "worker", "--join", "127.0.0.1:1", "--emulate", "2")
    assert proc.returncode == 2
    assert "--emulate needs --role local" in proc.stderr


def test_nodes_must_match_the_job(tmp_path: Path) -> None:
    """Without root this exits 2 saying what is missing; with root, naming the job's count."""
    config, _ = _job(tmp_path, "mismatch", replicas=2)
    proc = _node("--role", "local", "--config", str(config), "--emulate", "3:100mbit:5ms")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--emulate" in proc.stderr
    assert ("starts 2 replica process(es), not 3" if MISSING is None else MISSING) in proc.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="runs as root: the error without root cannot be seen")
def test_without_root_it_says_what_is_missing(tmp_path: Path) -> None:
    config, _ = _job(tmp_path, "noroot")
    proc = _node("--role", "local", "--config", str(config), "--emulate", "2")
    assert proc.returncode == 2
    assert "--emulate needs root" in proc.stderr


@needs_emulation
def test_a_node_gets_its_cpu_share() -> None:
    """Two busy loops on a host held to a quarter of a core share that quarter; the host next door has its own."""
    share, seconds = 0.25, 3.0
    with Emulation(["a", "b"], Link(1e9, 0.0), cpu_share=share) as emu:
        procs = [emu.popen(host, [sys.executable, "-c", BUSY.format(seconds=seconds)], stdout=subprocess.PIPE)
                 for host in ("a", "a", "b")]
        got = [float(p.communicate(timeout=60)[0]) for p in procs]
        stat = (emu.cgroup("a") / "cpu.stat").read_text()
    on_a, on_b = got[0] + got[1], got[2]
    # the quota caps a host's processes together (10% over for accounting at period edges)
    assert 0 < on_a <= share * 1.1 + 0.02, got
    assert 0 < on_b <= share * 1.1 + 0.02, got
    # and the host got its share: a period in which the kernel throttled its group is one in which the group used
    # its whole quota (its two loops wanted more). How much of the run a loaded machine allows that is its business
    # (a CI run beside another test file's jobs gave host a 0.045 of a core in all, b 0.042): not a lower bound here
    throttled = int(re.search(r"nr_throttled (\d+)", stat).group(1))  # type: ignore[union-attr]
    assert throttled > 0, stat


@needs_emulation
def test_a_shaped_link_delivers_its_rate_and_delay() -> None:
    """4 MB over a 20 Mbit/s link takes about 1.6 s; a ping through the 50 ms delay proxy about 100 ms."""
    rate, delay, size = 20e6, 0.05, 4_000_000
    with Emulation(["a", "b"], Link(rate, delay), cpu_share=1.0) as emu:
        server = emu.popen("b", [sys.executable, "-c", SERVER, emu.address("b")], stdout=subprocess.PIPE)
        assert server.stdout is not None and server.stdout.readline().strip() == b"up"
        client = emu.popen("a", [sys.executable, "-c", CLIENT, emu.address("b"), str(size)], stdout=subprocess.PIPE)
        out, _ = client.communicate(timeout=60)
        server.wait(timeout=30)
    measured = json.loads(out)
    expected = size * 8 / rate
    assert 0.85 * expected <= measured["transfer_s"] <= 3 * expected + 1.0, measured
    assert 2 * delay * 0.95 <= measured["rtt_s"] <= 2 * delay + 0.1, measured


@needs_emulation
def test_an_emulated_job_runs_and_leaves_nothing(tmp_path: Path) -> None:
    config, out = _job(tmp_path, "emulated", replicas=2, epochs=2)
    proc = _node("--role", "local", "--config", str(config), "--emulate", "2:100mbit:2ms")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rid = re.search(r"emulation ([0-9a-f]{8}):", proc.stdout).group(1)  # type: ignore[union-attr]
    summary = json.loads((out / "summary.json").read_text())
    cores = len(os.sched_getaffinity(0))
    emulation = summary["emulation"]
    dilation = max(1.0, 4 / cores)  # 2 replicas, 1 PS shard, the coordinator
    assert emulation["processes"] == 4 and emulation["nodes"] == 2
    assert emulation["dilation"] == pytest.approx(dilation)
    assert emulation["cpu_share"] == pytest.approx(min(1.0, cores / 4))
    assert emulation["shaped_bandwidth_bps"] == pytest.approx(100e6 / dilation)
    assert emulation["added_delay_s"] == pytest.approx(0.002 * dilation)
    assert emulation["detect_s"] == pytest.approx(3.0 * dilation)  # the failure detector runs on the dilated clock
    assert f"failure detection after {3.0 * dilation:g} s" in proc.stdout
    assert summary["wall_s"] == pytest.approx(emulation["measured_wall_s"] / dilation)
    assert summary["history"][-1]["wall_s"] <= summary["wall_s"] + 1e-9
    assert summary["stop_reason"] == "trained 2 epochs" and summary["final_accuracy"] > 0.5
    assert "time dilation" in proc.stdout
    cluster = json.loads((out / "cluster.json").read_text())
    assert sorted(c["address"].rsplit(":", 1)[0] for c in cluster["children"]) == [
        f"10.80.0.{i}" for i in range(1, 5)]  # every process on a host of its own
    _assert_nothing_left(rid, cluster)


@needs_emulation
def test_sigkill_of_the_launcher_leaves_nothing(tmp_path: Path) -> None:
    config, out = _job(tmp_path, "killed", replicas=2, epochs=5000)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config), "--emulate", "2:1gbit"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert launcher.stdout is not None
        first = launcher.stdout.readline()
        match = re.search(r"emulation ([0-9a-f]{8}):", first)
        assert match, first
        rid = match.group(1)
        deadline = time.monotonic() + 120
        cluster: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                cluster = json.loads((out / "cluster.json").read_text())
            except (OSError, ValueError):
                cluster = {}
            if cluster.get("state") == "training" and all(c["address"] for c in cluster["children"]):
                break
            time.sleep(0.2)
        assert cluster.get("state") == "training", cluster
    finally:
        launcher.kill()
        launcher.wait()
    _assert_nothing_left(rid, cluster)
