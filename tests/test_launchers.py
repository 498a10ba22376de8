"""``--role auto``: each launcher's variables give the documented roles; bad or missing ones fail at start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dniasync.cluster.config import Config, parse_config
from dniasync.node import main
from dniasync.node._launchers import (
    SLURM_PORT_BASE,
    LauncherError,
    detect_launcher,
    parse_nodelist,
    place,
    resolve_auto,
    role_of_rank,
    spares_problem,
)

ROOT = Path(__file__).resolve().parents[1]


def _raw(mode: str = "downpour", out: str = "runs/t", **stop: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {"downpour": {"n_replicas": 2, "n_ps_shards": 2}, "hogwild": {"n_workers": 1}}[mode]
    return {
        "job": {"name": "auto_digits", "mode": mode, "output_dir": out},
        "model": {"factory": "dniasync.train.models:mlp", "kwargs": {"sizes": [64, 32, 10]}},
        "data": {"dataset": "digits", "n_train": 1400, "n_test": 397, "batch_size": 32},
        "optimizer": {"name": "adagrad" if mode == "downpour" else "sgd", "lr": 0.05 if mode == "downpour" else 0.1},
        mode: settings,
        "stop": {"max_epochs": 20, "target_accuracy": 0.8, "max_seconds": 120, **stop},
        "eval": {"every_seconds": 0.5},
    }


@pytest.fixture(scope="module")
def downpour() -> Config:
    """Two PS shards and two replicas: five ranks."""
    return parse_config(_raw(), resolve=False)


def _toml(raw: dict[str, Any]) -> str:
    lines: list[str] = []
    for section, table in raw.items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            if isinstance(value, dict):
                continue
            lines.append(f"{key} = {json.dumps(value)}")
        for key, value in table.items():
            if isinstance(value, dict):
                lines.append(f"[{section}.{key}]")
                lines.extend(f"{k} = {json.dumps(v)}" for k, v in value.items())
    return "\n".join(lines) + "\n"


def _slurm(rank: int, ntasks: int = 5, nodelist: str = "vm", **extra: str) -> dict[str, str]:
    """What ``srun`` sets for ``rank`` (on the first node unless SLURMD_NODENAME says otherwise)."""
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks), "SLURM_JOB_NODELIST": nodelist,
           "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    try:
        env["SLURMD_NODENAME"] = parse_nodelist(nodelist)[0]
    except ValueError:
        pass
    env.update(extra)
    return env


def _torchrun(rank: int, world: int = 5, addr: str = "127.0.0.1", port: int = 29500, **extra: str) -> dict[str, str]:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": addr, "MASTER_PORT": str(port)}
    env.update(extra)
    return env


def _pet(rank: int, nodes: int = 5, addr: str = "trainjob-node-0-0.trainjob", **extra: str) -> dict[str, str]:
    env = {"PET_NODE_RANK": str(rank), "PET_NNODES": str(nodes), "PET_MASTER_ADDR": addr,
           "PET_MASTER_PORT": "29400", "PET_NPROC_PER_NODE": "1"}
    env.update(extra)
    return env


# -- Slurm host lists ------------------------------------------------------------------

@pytest.mark.parametrize(("text", "hosts"), [
    ("vm", ["vm"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("gpu5,node[1]", ["gpu5", "node1"]),
    ("a-b.example.org,c[3]x", ["a-b.example.org", "c3x"]),
])
def test_nodelist_expands_like_scontrol_show_hostnames(text: str, hosts: list[str]) -> None:
    assert parse_nodelist(text) == hosts


@pytest.mark.parametrize(("text", "problem"), [
    ("", "empty host name"),
    ("node[1-3", "unbalanced '\\['"),
    ("node1-3]", "unbalanced '\\]'"),
    ("node[3-1]", "runs backwards"),
    ("node[a-b]", "bad range 'a-b'"),
    ("node[[1]]", "nested"),
    ("a,,b", "empty host name"),
])
def test_nodelist_rejects_malformed_lists(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_nodelist(text)


# -- which launcher, which rank --------------------------------------------------------

def test_slurm_gives_rank_world_and_a_port_from_the_job_id() -> None:
    env = detect_launcher(_slurm(3))
    assert (env.launcher, env.rank, env.world_size, env.job_id) == ("slurm", 3, 5, "4242")
    assert env.port == SLURM_PORT_BASE + 4242 and env.one_host and env.coordinator_host == "127.0.0.1"


def test_slurm_across_hosts_finds_the_coordinator_on_the_first_host() -> None:
    env = detect_launcher(_slurm(2, nodelist="node[07-08],gpu5", SLURMD_NODENAME="node08", DNIASYNC_PORT="7001"))
    assert (env.coordinator_host, env.port, env.one_host) == ("node07", 7001, False)


def test_slurm_prefers_the_step_nodelist_and_task_count() -> None:
    env = detect_launcher(_slurm(0, ntasks=9, nodelist="a[1-4]", SLURM_STEP_NODELIST="a2",
                                 SLURM_STEP_NUM_TASKS="5", SLURMD_NODENAME="a2"))
    assert (env.world_size, env.one_host) == (5, True)


@pytest.mark.parametrize(("env", "named"), [
    ({k: v for k, v in _slurm(1).items() if k != "SLURM_STEP_ID"}, "SLURM_STEP_ID.*start every rank with srun"),
    ({k: v for k, v in _slurm(1).items() if k != "SLURM_NTASKS"}, "without SLURM_NTASKS"),
    ({k: v for k, v in _slurm(1).items() if k != "SLURM_JOB_NODELIST"}, "without SLURM_JOB_NODELIST"),
    ({k: v for k, v in _slurm(1).items() if k != "SLURM_JOB_ID"}, "without SLURM_JOB_ID"),
    (_slurm(1, SLURM_PROCID="one"), "SLURM_PROCID='one' is not an integer"),
    (_slurm(5), "SLURM_PROCID=5 is not below SLURM_NTASKS=5"),
    (_slurm(1, nodelist="node[1-"), "SLURM_JOB_NODELIST: unbalanced"),
    (_slurm(0, nodelist="a,b", SLURMD_NODENAME="b"), "rank 0 runs on SLURMD_NODENAME=b, not on the first host"),
    (_slurm(1, DNIASYNC_PORT="70000"), "DNIASYNC_PORT=70000 is not a TCP port"),
])
def test_bad_or_missing_slurm_variables_are_named(env: dict[str, str], named: str) -> None:
    with pytest.raises(LauncherError, match=named):
        detect_launcher(env)


def test_torchrun_coordinator_port_is_one_above_master_port() -> None:
    env = detect_launcher(_torchrun(4, addr="10.1.2.3", port=29500))
    assert (env.launcher, env.rank, env.world_size) == ("torch-style", 4, 5)
    assert (env.coordinator_host, env.port, env.one_host) == ("10.1.2.3", 29501, False)
    assert detect_launcher(_torchrun(0, DNIASYNC_PORT="7100")).port == 7100


def test_torchrun_on_one_node_stays_on_loopback() -> None:
    env = detect_launcher(_torchrun(1, addr="vm.example.org", LOCAL_WORLD_SIZE="5", TORCHELASTIC_RUN_ID="x"))
    assert (env.launcher, env.coordinator_host, env.one_host) == ("torchrun", "127.0.0.1", True)


def test_torchrun_variables_win_over_slurms() -> None:
    env = detect_launcher({**_slurm(0, ntasks=2), **_torchrun(3)})
    assert (env.launcher, env.rank, env.world_size) == ("torch-style", 3, 5)


@pytest.mark.parametrize(("env", "named"), [
    ({k: v for k, v in _torchrun(1).items() if k != "MASTER_PORT"}, "without MASTER_PORT"),
    ({k: v for k, v in _torchrun(1).items() if k not in ("MASTER_ADDR", "WORLD_SIZE")},
     "without WORLD_SIZE, MASTER_ADDR"),
    (_torchrun(1, addr="bad host"), "MASTER_ADDR='bad host' is not a host"),
    (_torchrun(7), "RANK=7 is not below WORLD_SIZE=5"),
    (_torchrun(1, port=65535), "MASTER_PORT=65535 leaves no port above it"),
    ({"WORLD_SIZE": "4", "MASTER_ADDR": "h"}, "WORLD_SIZE, MASTER_ADDR set but not RANK"),
    ({}, "found no launcher environment.*SLURM_PROCID.*RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
])
def test_bad_or_missing_torchrun_variables_are_named(env: dict[str, str], named: str) -> None:
    with pytest.raises(LauncherError, match=named):
        detect_launcher(env)


def test_kubeflow_trainer_pet_variables() -> None:
    env = detect_launcher(_pet(2))
    assert (env.launcher, env.rank, env.world_size) == ("kubeflow", 2, 5)
    assert (env.coordinator_host, env.port, env.one_host) == ("trainjob-node-0-0.trainjob", 29401, False)


@pytest.mark.parametrize(("env", "named"), [
    (_pet(1, PET_NPROC_PER_NODE="4"), "PET_NPROC_PER_NODE='4'.*numProcPerNode to 1"),
    ({k: v for k, v in _pet(1).items() if k != "PET_MASTER_PORT"}, "without PET_MASTER_PORT"),
    (_pet(5), "PET_NODE_RANK=5 is not below PET_NNODES=5"),
])
def test_bad_or_missing_pet_variables_are_named(env: dict[str, str], named: str) -> None:
    with pytest.raises(LauncherError, match=named):
        detect_launcher(env)


# -- roles and addresses ----------------------------------------------------------------

def test_ranks_take_the_roles_the_job_asks_for(downpour: Config) -> None:
    roles = [place(detect_launcher(_slurm(rank)), downpour).role for rank in range(5)]
    assert roles == ["coordinator", "ps", "ps", "worker", "worker"]
    assert [role_of_rank(r, 0) for r in range(3)] == ["coordinator", "worker", "worker"]


@pytest.mark.parametrize("launcher", [_slurm, _torchrun, _pet])
def test_each_launcher_gives_the_same_roles(downpour: Config, launcher: Any) -> None:
    roles = [place(detect_launcher(launcher(rank)), downpour, route=lambda h, p: "10.0.0.9").role
             for rank in range(5)]
    assert roles == ["coordinator", "ps", "ps", "worker", "worker"]


def test_on_one_host_everything_listens_on_loopback(downpour: Config) -> None:
    coordinator = place(detect_launcher(_slurm(0)), downpour)
    assert (coordinator.listen, coordinator.join, coordinator.advertise) == ("127.0.0.1:14242", None, None)
    worker = place(detect_launcher(_slurm(4)), downpour)
    assert (worker.listen, worker.join) == ("127.0.0.1:0", "127.0.0.1:14242")
    assert "slurm rank 4 of 5, job 4242 -> worker; coordinator at 127.0.0.1:14242" in worker.describe()


def test_across_hosts_the_coordinator_serves_every_interface_and_others_the_route_to_it(downpour: Config) -> None:
    nodes = "node[1-3]"
    coordinator = place(detect_launcher(_slurm(0, nodelist=nodes)), downpour)
    assert (coordinator.listen, coordinator.advertise) == ("0.0.0.0:14242", "node1:14242")
    asked: list[tuple[str, int]] = []

    def route(host: str, port: int) -> str:
        asked.append((host, port))
        return "10.0.0.7"

    ps = place(detect_launcher(_slurm(1, nodelist=nodes, SLURMD_NODENAME="node2")), downpour, route=route)
    assert (ps.role, ps.listen, ps.join, ps.advertise) == ("ps", "10.0.0.7:0", "node1:14242", None)
    assert asked == [("node1", 14242)]


def test_a_world_size_that_does_not_fit_the_job_fails_naming_both(downpour: Config) -> None:
    with pytest.raises(LauncherError, match=r"started 4 rank\(s\) \(SLURM_PROCID, SLURM_NTASKS.*needs 5: "
                                            r"1 coordinator, 2 PS shard\(s\), 2 replica\(s\); "
                                            r"set sbatch/srun --ntasks to 5"):
        place(detect_launcher(_slurm(0, ntasks=4)), downpour)
    with pytest.raises(LauncherError, match="set WORLD_SIZE .* to 5"):
        place(detect_launcher(_torchrun(0, world=6)), downpour)


def test_a_standby_coordinator_is_the_rank_after_the_workers_and_follows_rank_0() -> None:
    """``[job] standby = true`` under ``--role auto``: one more rank, before any spare; it follows rank 0 (``--join``)
    and listens where the members do, so the other ranks reach it once it takes the job over."""
    raw = _raw()
    raw["job"]["standby"] = True
    config = parse_config(raw, resolve=False)
    roles = [place(detect_launcher(_slurm(rank, ntasks=6)), config).role for rank in range(6)]
    assert roles == ["coordinator", "ps", "ps", "worker", "worker", "standby"]
    assert [role_of_rank(r, 1, 1, standby=True) for r in range(5)] == ["coordinator", "ps", "worker", "standby",
                                                                       "spare"]
    standby = place(detect_launcher(_slurm(5, ntasks=6)), config)
    assert (standby.listen, standby.join) == ("127.0.0.1:0", "127.0.0.1:14242")
    across = place(detect_launcher(_slurm(5, ntasks=6, nodelist="node[1-3]", SLURMD_NODENAME="node3")), config,
                   route=lambda h, p: "10.0.0.8")
    assert (across.role, across.listen, across.join) == ("standby", "10.0.0.8:0", "node1:14242")
    with pytest.raises(LauncherError, match=r"needs 6: 1 coordinator, 2 PS shard\(s\), 2 replica\(s\), 1 standby "
                                            r"coordinator \(job.standby\); set sbatch/srun --ntasks to 6$"):
        place(detect_launcher(_slurm(0, ntasks=5)), config)


@pytest.fixture(scope="module")
def replicated() -> Config:
    """Two PS shards of two copies each and two replicas: seven ranks, and the spares."""
    raw = _raw()
    raw["downpour"]["ps_replicas"] = 2
    return parse_config(raw, resolve=False)


def test_spares_are_the_last_ranks_and_count_in_the_world_size(replicated: Config) -> None:
    roles = [place(detect_launcher(_slurm(rank, ntasks=9)), replicated, spares=2).role for rank in range(9)]
    assert roles == ["coordinator", *["ps"] * 4, "worker", "worker", "spare", "spare"]
    assert [role_of_rank(r, 1, 1) for r in range(4)] == ["coordinator", "ps", "worker", "spare"]
    spare = place(detect_launcher(_torchrun(7, world=8)), replicated, spares=1)
    assert (spare.role, spare.join) == ("spare", "127.0.0.1:29501")
    assert "rank 7 of 8 -> spare; coordinator at 127.0.0.1:29501" in spare.describe()
    with pytest.raises(LauncherError, match=r"started 8 rank\(s\) .* needs 9: 1 coordinator, 4 PS shard\(s\), 2 "
                                            r"replica\(s\), 2 spare\(s\) \(--spares\); set sbatch/srun --ntasks to 9$"):
        place(detect_launcher(_slurm(0, ntasks=8)), replicated, spares=2)
    with pytest.raises(LauncherError, match=r"needs 7: .*set sbatch/srun --ntasks to 7 \(or keep the 2 extra rank\(s\) "
                                            r"as spares: --spares 2\)"):
        place(detect_launcher(_slurm(0, ntasks=9)), replicated)


def test_spares_need_replicated_ps_shards(downpour: Config, replicated: Config) -> None:
    assert spares_problem(replicated) is None
    with pytest.raises(LauncherError, match=r"^--spares 1: a spare stands in for a dead copy of a replicated PS shard, "
                                            r"and job auto_digits \(j.toml\) has downpour.ps_replicas = 1: set it to "
                                            r"2 or more; or drop --spares$"):
        place(detect_launcher(_slurm(0, ntasks=6)), downpour, "j.toml", spares=1)
    with pytest.raises(LauncherError, match=r"--spares 1: .* has no replicated PS shards \(mode hogwild"):
        place(detect_launcher(_slurm(0, ntasks=3)), parse_config(_raw("hogwild"), resolve=False), spares=1)
    with pytest.raises(LauncherError, match="needs 5") as refused:
        place(detect_launcher(_slurm(0, ntasks=6)), downpour)
    assert "spares" not in str(refused.value)  # a job without copies to stand in for gets no hint about them


def test_across_hosts_a_token_is_required_from_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(_toml(_raw()))
    with pytest.raises(LauncherError, match="several hosts.*DNIASYNC_TOKEN_FILE.*DNIASYNC_TOKEN"):
        resolve_auto(str(config), _slurm(1, nodelist="localhost,vm", SLURMD_NODENAME="vm"))
    with pytest.raises(LauncherError, match="DNIASYNC_TOKEN holds 5 bytes"):
        resolve_auto(str(config), _slurm(1, DNIASYNC_TOKEN="short"))
    token = "t" * 24
    auto = resolve_auto(str(config), _slurm(1, nodelist="localhost,vm", SLURMD_NODENAME="vm",
                                            DNIASYNC_TOKEN=token))
    assert (auto.token, auto.token_file) == (token.encode(), None)
    auto = resolve_auto(str(config), _slurm(1, DNIASYNC_TOKEN=token, DNIASYNC_TOKEN_FILE="/shared/t"))
    assert (auto.token, auto.token_file) == (None, "/shared/t")


# -- the command line ---------------------------------------------------------------------

def test_cli_fails_at_start_naming_the_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "job.toml"
    config.write_text(_toml(_raw()))
    for name in [n for n in os.environ if n.startswith(("SLURM", "PET_", "DNIASYNC_")) or n in
                 ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")]:
        monkeypatch.delenv(name)
    assert main(["--role", "auto", "--config", str(config)]) == 2
    assert "found no launcher environment" in capsys.readouterr().err
    for key, value in _slurm(1, ntasks=3).items():
        monkeypatch.setenv(key, value)
    assert main(["--role", "auto", "--config", str(config)]) == 2
    assert "started 3 rank(s)" in capsys.readouterr().err
    assert main(["--role", "auto"]) == 2
    assert "--role auto needs --config JOB.toml" in capsys.readouterr().err
    assert main(["--role", "auto", "--config", str(config), "--join", "127.0.0.1:1"]) == 2
    assert "drop --join" in capsys.readouterr().err
    for key, value in _slurm(1, ntasks=6).items():
        monkeypatch.setenv(key, value)
    assert main(["--role", "auto", "--config", str(config), "--spares", "1"]) == 2  # the job has one copy per shard
    assert "--spares 1: a spare stands in for a dead copy of a replicated PS shard" in capsys.readouterr().err
    assert main(["--role", "local", "--config", str(config), "--spares", "1"]) == 2
    assert "--spares is for --role auto" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["--role", "auto", "--config", str(config), "--spares", "-1"])
    assert exited.value.code == 2 and "argument --spares: '-1' is not a count" in capsys.readouterr().err


# -- a real job under torchrun ---------------------------------------------------------------

@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun is not installed next to this Python (it comes with torch)")
def test_a_hogwild_job_under_torchrun_takes_its_roles_and_ends_with_the_job(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = tmp_path / "hogwild.toml"
    config.write_text(_toml(_raw("hogwild", str(out))))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "PET_", "DNIASYNC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2",
         "-m", "dniasync.node", "--role", "auto", "--config", str(config)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torchrun rank 0 of 2" in proc.stdout and "-> coordinator; coordinator at 127.0.0.1:" in proc.stdout
    assert "torchrun rank 1 of 2" in proc.stdout and "-> worker; coordinator at 127.0.0.1:" in proc.stdout
    assert "dniasync rank 1 (worker): job finished; stopping" in proc.stdout
    assert "dniasync rank 0 (coordinator): job finished; stopping" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    # how many evaluations fit before the epoch budget depends on the machine's load: either ending is the job's
    assert summary["stop_reason"] in ("reached target accuracy 0.8", "trained 20 epochs")
    assert summary["final_accuracy"] >= 0.8
