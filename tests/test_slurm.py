"""The Slurm examples on a real one-host Slurm cluster: munged, slurmctld and slurmd from Debian.

The cluster runs from a generated ``slurm.conf`` in a temporary directory
(its own munge key and socket, its own ports, no cgroups) and is stopped,
every daemon, when the module's tests are done. The jobs are the sbatch
scripts of ``examples/slurm/`` as a user submits them, given a small digits
job of the same shape.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dniasync.cluster.chains import SPARE_HOST, copies_placed
from dniasync.cluster.config import load_config
from dniasync.cluster.modes import get_mode

ROOT = Path(__file__).resolve().parents[1]
SBATCH_DIR = ROOT / "examples" / "slurm"
DOWNPOUR = SBATCH_DIR / "downpour_mnist.sbatch"
ROLES = ["coordinator", "ps", "ps", "worker", "worker"]
"""What --role auto makes of the five ranks of the Downpour example (2 PS shards, 2 replicas)."""

_SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
_TOOLS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol")
KILL_WAIT_S = 30
"""slurm.conf's KillWait: ranks still running this long after SIGTERM get SIGKILL."""

JOB = """\
[job]
name = "slurm_digits"
mode = "downpour"
seed = 0
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"

[model.kwargs]
sizes = [64, 32, 10]

[data]
dataset = "digits"
n_train = 1400
n_test = 397
batch_size = 32

[optimizer]
name = "adagrad"
lr = 0.05

[downpour]
n_replicas = 2
n_ps_shards = 2

[stop]
max_epochs = {max_epochs}
{target}
max_seconds = {max_seconds}

[eval]
every_seconds = 0.5
"""


def _slurm_unavailable() -> str | None:
    """Why the Slurm tests cannot run here, or None."""
    missing = [tool for tool in _TOOLS if shutil.which(tool, path=_SBIN) is None]
    if missing:
        why = f"Slurm is not installed (no {', '.join(missing)}): `apt-get install slurm-wlm munge` (.ci/run does)"
        if os.environ.get("CI") == "true" and os.geteuid() == 0:
            pytest.fail(f"{why}; .ci/run should have installed it")  # CI as root must run this test
        return why
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps (run as root, as .ci/run does)"
    return None


def _wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _processes_with(marker: str) -> list[str]:
    """Command lines of the running processes that mention ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline.strip()}")
    return found


class SlurmCluster:
    """munged + slurmctld + slurmd for this host, from files in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = socket.gethostname()
        try:
            socket.gethostbyname(self.node)
        except OSError:
            self.node = "localhost"  # srun and slurmstepd find each other by the node's name
        self.conf = root / "slurm.conf"
        self.daemons: list[tuple[str, subprocess.Popen[bytes]]] = []
        keep = {k: v for k, v in os.environ.items()
                if not k.startswith(("SLURM", "PET_", "DNIASYNC_"))
                and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
        self.env = dict(keep, SLURM_CONF=str(self.conf),
                        PATH=os.pathsep.join([str(Path(sys.executable).parent), _SBIN]))
        """What jobs are submitted with: this Python first on PATH, as an activated environment has it."""

    def write_files(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for name in ("state", "spool"):
            (self.root / name).mkdir()
        r = self.root
        self.conf.write_text(f"""\
ClusterName=dniasync
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge.sock
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={KILL_WAIT_S}
MinJobAge=600
NodeName={self.node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def run(self, *cmd: str, timeout: float = 30.0, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([shutil.which(cmd[0], path=_SBIN) or cmd[0], *cmd[1:]], capture_output=True,
                              text=True, timeout=timeout, env=dict(self.env, **env), cwd=self.root)

    def _daemon(self, name: str, *args: str) -> None:
        log = (self.root / f"{name}.out").open("wb")
        proc = subprocess.Popen([shutil.which(name, path=_SBIN) or name, *args], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env)
        log.close()
        self.daemons.append((name, proc))

    def _alive(self) -> None:
        for name, proc in self.daemons:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}): "
                                     + (self.root / f"{name}.out").read_text()[-2000:])

    def start(self) -> None:
        self.write_files()
        r = self.root
        self._daemon("munged", "-F", f"--key-file={r}/munge.key", f"--socket={r}/munge.sock",
                     f"--pid-file={r}/munged.pid", f"--log-file={r}/munged.log", f"--seed-file={r}/munge.seed")
        _wait_for(lambda: self._alive() or self.run("munge", "-n", "-S", f"{r}/munge.sock").returncode == 0,
                  20, "munged to answer")
        self._daemon("slurmctld", "-D", "-i", "-f", str(self.conf))
        _wait_for(lambda: self._alive() or self.run("scontrol", "ping").stdout.count("UP") > 0,
                  60, "slurmctld to answer `scontrol ping`")
        self._daemon("slurmd", "-D", "-f", str(self.conf), "-N", self.node)
        _wait_for(lambda: self._alive() or self.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip() == "idle",
                  60, "sinfo to show the node idle")

    def jobs(self) -> str:
        return self.run("squeue", "-h", "-o", "%i %T").stdout.strip()

    def job_state(self, job_id: str) -> str:
        match = re.search(r"JobState=(\w+)", self.run("scontrol", "show", "job", job_id).stdout)
        return match.group(1) if match else ""

    def stop(self) -> None:
        if any(proc.poll() is None for name, proc in self.daemons if name == "slurmctld"):
            self.run("scancel", f"--user={pwd.getpwuid(os.getuid()).pw_name}")
            try:
                _wait_for(lambda: not self.jobs(), KILL_WAIT_S + 30, "every job to end")
            except AssertionError:
                pass  # stop the daemons regardless
        for name, proc in reversed(self.daemons):  # slurmd, then slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    why = _slurm_unavailable()
    if why:
        pytest.skip(why)
    # munged wants its socket's directory open to all: not pytest's private tmp_path
    root = Path(tempfile.mkdtemp(prefix="dniasync-slurm-", dir="/tmp"))
    root.chmod(0o755)
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        left = _processes_with(str(root))
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"Slurm daemons left running: {left}"


def _rank_process(job_id: str, rank: int) -> int:
    """The pid of rank ``rank`` of Slurm job ``job_id`` (the Python process srun started, not srun)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if (argv[1:3] == [b"-m", b"dniasync.node"] and f"SLURM_JOB_ID={job_id}".encode() in environ
                and f"SLURM_PROCID={rank}".encode() in environ):
            return int(entry.name)
    raise AssertionError(f"no process of rank {rank} of job {job_id}")


def _job(tmp_path: Path, *, target: float | None, max_seconds: int = 240, max_epochs: int = 50) -> Path:
    config = tmp_path / "job.toml"
    config.write_text(JOB.format(
        out=tmp_path / "run", max_epochs=max_epochs, max_seconds=max_seconds,
        target="" if target is None else f"target_accuracy = {target}",
    ))
    return config


def _sbatch(slurm: SlurmCluster, tmp_path: Path, config: Path, *options: str, timeout: float = 30.0,
            **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    proc = slurm.run("sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%j.out",
                     *options, str(DOWNPOUR), str(config), timeout=timeout, **env)
    job_id = proc.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch did not submit: {proc.stdout}{proc.stderr}"
    return proc, job_id


def test_every_example_job_has_an_sbatch_script_asking_for_its_ranks() -> None:
    """Each example TOML has examples/slurm/<name>.sbatch whose --ntasks is the job's rank count."""
    for toml in sorted((ROOT / "examples").glob("*.toml")):
        script = SBATCH_DIR / f"{toml.stem}.sbatch"
        assert script.exists(), f"no {script.relative_to(ROOT)} for {toml.name}"
        text = script.read_text()
        config = load_config(toml)
        n_ps, n_workers = get_mode(config.mode).processes(config)
        assert f"#SBATCH --ntasks={1 + n_ps + n_workers}\n" in text, script.name
        assert f'config="${{1:-examples/{toml.name}}}"' in text, script.name
        assert "srun --label python -m dniasync.node --role auto --config \"$config\"" in text, script.name
        if config.sync_kind == "shm":
            assert "#SBATCH --nodes=1\n" in text, f"{script.name}: its trainers share one store in memory on one node"
    for script in SBATCH_DIR.glob("*.sbatch"):
        assert (ROOT / "examples" / f"{script.stem}.toml").exists(), f"{script.name} has no example job"


def test_downpour_example_under_sbatch_reaches_its_target_and_leaves_nothing(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    config = _job(tmp_path, target=0.8)
    _, job_id = _sbatch(slurm, tmp_path, config)
    # polled here rather than with sbatch --wait, whose own polling backs off to many seconds between looks
    _wait_for(lambda: slurm.job_state(job_id) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 420,
              f"job {job_id} to end")
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    for rank, role in enumerate(ROLES):
        assert f"{rank}: dniasync --role auto: slurm rank {rank} of 5, job {job_id} -> {role}; " \
               f"coordinator at 127.0.0.1:{10000 + int(job_id)}" in log, log
        assert re.search(rf"^{rank}: dniasync node {role} listening on 127\.0\.0\.1:\d+$", log, re.M), log
        assert f"{rank}: dniasync rank {rank} ({role}): job finished; stopping" in log, log
    assert "0: job slurm_digits (downpour) finished: reached target accuracy 0.8" in log
    assert "Traceback" not in log, log
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stop_reason"] == "reached target accuracy 0.8"
    assert summary["final_accuracy"] >= 0.8
    assert slurm.job_state(job_id) == "COMPLETED"
    assert not _processes_with(str(config)), "ranks left running after the job ended"


def _submit_until_trained(slurm: SlurmCluster, tmp_path: Path, script: str, config: Path) -> tuple[str, Path, str]:
    """Submit the batch ``script`` for ``config``; once rank 0 has evaluated trained weights: the job id, its
    output file and the output so far (an error if the job ended before)."""
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    proc = slurm.run("sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%j.out",
                     str(path), str(config))
    job_id = proc.stdout.strip().split(";")[0]
    assert job_id.isdigit(), f"sbatch did not submit: {proc.stdout}{proc.stderr}"
    output = tmp_path / f"slurm-{job_id}.out"

    def trained() -> str:
        if slurm.job_state(job_id) not in ("PENDING", "RUNNING"):
            raise AssertionError(f"job {job_id} ended early:\n" + (output.read_text() if output.exists() else ""))
        text = output.read_text() if output.exists() else ""
        evals = [line for line in text.splitlines() if line.startswith("0: ") and " eval: " in line]
        return text if any(" 0 samples" not in line for line in evals) else ""

    return job_id, output, _wait_for(trained, 300, "the job to train", every=0.2)


SPARES_SCRIPT = """\
#!/bin/bash
#SBATCH --ntasks=6
#SBATCH --cpus-per-task=1
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
srun --label python -m dniasync.node --role auto --config "$1" --spares 1
"""
SPARES_ROLES = ["coordinator", "ps", "ps", "worker", "worker", "spare"]
"""One PS shard with two copies, two replicas and one spare: six ranks."""


def test_a_spare_takes_the_place_of_a_killed_ps_copy_and_nothing_acknowledged_is_lost(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """``--role auto --spares 1`` with ``ps_replicas = 2``: SIGKILL of the head copy mid-run; the chain closes
    around it, the spare rank takes its place and catches up from the tail, and the job finishes with every push
    the replicas saw acknowledged on both copies."""
    config = _job(tmp_path, target=None, max_seconds=14, max_epochs=100_000)
    config.write_text(config.read_text().replace("n_ps_shards = 2", "n_ps_shards = 1\nps_replicas = 2"))
    job_id, output, log = _submit_until_trained(slurm, tmp_path, SPARES_SCRIPT, config)
    nodes = dict((int(rank), address) for rank, address in
                 re.findall(r"^(\d+): dniasync node (?:ps|spare) listening on (\S+)$", log, re.M))
    head = next(address for address, where in copies_placed(log).items() if where == (0, 0))
    rank = next(r for r, address in nodes.items() if address == head)
    os.kill(_rank_process(job_id, rank), signal.SIGKILL)
    _wait_for(lambda: slurm.job_state(job_id) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 120,
              f"job {job_id} to end")
    log = output.read_text()
    for r, role in enumerate(SPARES_ROLES):
        assert f"{r}: dniasync --role auto: slurm rank {r} of 6, job {job_id} -> {role}; " in log, log
        if r != rank:
            assert f"{r}: dniasync rank {r} ({role}): job finished; stopping" in log, log
    assert "Traceback" not in log and "version went back" not in log and "failed for" not in log, log
    # srun returns the killed task's status: Slurm calls the job FAILED, though the job itself finished
    assert slurm.job_state(job_id) == "FAILED"
    doc = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert doc["stop_reason"] == "ran 14 s", doc["stop_reason"]
    assert doc["final_accuracy"] >= 0.8, doc["history"]  # the job's target elsewhere in this file: it got there
    events = {e["kind"]: e for e in doc["events"] if e["kind"].startswith("ps_copy")}
    spare = f"{SPARE_HOST}@{nodes[5]}"
    assert events["ps_copy_down"]["address"].endswith(f"@{head}"), doc["events"]
    assert events["ps_copy_replaced"]["member"] == spare and events["ps_copy_joined"]["member"] == spare, events
    metrics = doc["metrics"]
    assert metrics["ps_copies_replaced"] == 1
    assert metrics["ps0_copy0_in_chain"] == metrics["ps0_copy1_in_chain"] == 1, metrics  # back to two copies
    assert metrics["ps0_copy1_transfers"] == 1 and metrics["ps0_copy0_version"] == metrics["ps0_copy1_version"]
    assert metrics["ps0_copy0_divergent"] == metrics["ps0_copy1_divergent"] == 0
    assert metrics["ps_acknowledged_pushes"] > 0
    assert metrics["ps_acknowledged_pushes_kept"] == metrics["ps_acknowledged_pushes"], metrics
    print(f"spare joined {events['ps_copy_joined']['wall_s'] - events['ps_copy_down']['wall_s']:.1f} s after "
          "the copy was missed")


STANDBY_SCRIPT = """\
#!/bin/bash
#SBATCH --ntasks=6
#SBATCH --cpus-per-task=1
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
srun --label python -m dniasync.node --role auto --config "$1"
"""
STANDBY_ROLES = ["coordinator", "ps", "ps", "worker", "worker", "standby"]
"""``[job] standby = true``: the job's five ranks and its standby coordinator."""


def test_a_standby_rank_takes_the_job_over_when_rank_0_is_killed_and_every_rank_follows_it(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """``[job] standby = true`` under ``--role auto``: SIGKILL of rank 0 mid-run; the standby rank takes the job over
    (epoch 2) with the same processes, the other ranks follow it, and it ends the job with one summary."""
    config = _job(tmp_path, target=None, max_seconds=14, max_epochs=100_000)
    config.write_text(config.read_text().replace('output_dir =', 'standby = true\noutput_dir ='))
    job_id, output, log = _submit_until_trained(slurm, tmp_path, STANDBY_SCRIPT, config)
    standby = re.search(r"^5: dniasync node standby listening on (\S+)$", log, re.M)
    assert standby is not None, log
    os.kill(_rank_process(job_id, 0), signal.SIGKILL)
    _wait_for(lambda: slurm.job_state(job_id) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 180,
              f"job {job_id} to end")
    log = output.read_text()
    for r, role in enumerate(STANDBY_ROLES):
        assert f"{r}: dniasync --role auto: slurm rank {r} of 6, job {job_id} -> {role}; " in log, log
    assert "5: dniasync rank 5 (standby): took the job over" in log, log
    for r, role in enumerate(STANDBY_ROLES[1:5], start=1):
        assert f"{r}: dniasync rank {r} ({role}): following the coordinator at {standby.group(1)}" in log, log
    for r, role in enumerate(STANDBY_ROLES[1:], start=1):
        assert f"{r}: dniasync rank {r} ({role}): job finished; stopping" in log, log
    assert "5: job slurm_digits (downpour) finished: ran 14 s" in log, log
    assert "Traceback" not in log, log
    assert slurm.job_state(job_id) == "FAILED"  # srun returns the killed rank 0's status
    doc = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert doc["stop_reason"] == "ran 14 s", doc["stop_reason"]
    takeovers = [e for e in doc["events"] if e["kind"] == "coordinator_takeover"]
    assert [e["epoch"] for e in takeovers] == [2], doc["events"]
    kinds = [e["kind"] for e in doc["events"]]
    assert "replica_failed" not in kinds and "ps_restarted" not in kinds, kinds  # the same processes went on
    rows = [(row["wall_s"], row["samples"]) for row in doc["history"]]
    assert rows == sorted(set(rows)), rows  # one history: in time order, no row twice
    assert not _processes_with(str(config)), "ranks left running after the job ended"


def test_scancel_stops_every_rank_cleanly(slurm: SlurmCluster, tmp_path: Path) -> None:
    config = _job(tmp_path, target=None, max_seconds=600, max_epochs=100000)
    # one output file per rank, written by slurmstepd: what a rank prints while srun is torn down is kept
    _, job_id = _sbatch(slurm, tmp_path, config, SLURM_STDOUTMODE=str(tmp_path / "rank-%t.log"))
    logs = [tmp_path / f"rank-{rank}.log" for rank in range(len(ROLES))]

    def text(rank: int) -> str:
        return logs[rank].read_text() if logs[rank].exists() else ""

    def training() -> bool:
        if slurm.job_state(job_id) not in ("PENDING", "RUNNING"):
            raise AssertionError(f"job {job_id} ended early:\n" + "\n".join(text(r) for r in range(len(ROLES))))
        return "0: dniasync rank 0 (coordinator): job training" in text(0) and all(
            "joined the cluster" in text(rank) for rank in range(1, len(ROLES)))

    _wait_for(training, 300, "every rank to join and training to start", every=0.5)
    assert _processes_with(str(config)), "no rank is running"
    result = slurm.run("scancel", job_id)
    assert result.returncode == 0, result.stderr
    # gone well before KillWait: they stopped on SIGTERM, not on the SIGKILL that follows it
    _wait_for(lambda: not _processes_with(str(config)), KILL_WAIT_S - 10, "every rank to exit after scancel")
    for rank, role in enumerate(ROLES):
        log = text(rank)
        assert f"{rank}: dniasync rank {rank} ({role}): stopping on a signal" in log, log
        assert "Traceback" not in log, log
    _wait_for(lambda: slurm.job_state(job_id) == "CANCELLED", 30, f"job {job_id} to show CANCELLED")
    _wait_for(lambda: not slurm.jobs(), 60, "the queue to empty")
