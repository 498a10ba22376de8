"""Sandblaster L-BFGS: the Rust vector kernels, the vector-free driver against the reference (and
torch.optim.LBFGS), the work queue, and whole jobs in real processes (exactness, coordinator
traffic, a killed replica, a frozen one)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from _jobs import launch_two_at_a_time
from dniasync import _core
from dniasync.cluster.config import load_config
from dniasync.cluster.modes.sandblaster import PARAMS_FILE
from dniasync.cluster.plan import data_spec, model_spec
from dniasync.train.lbfgs import LBFGSSettings, LocalGroup, VectorFreeLBFGS, reference_lbfgs
from dniasync.train.sandblaster import IDLE
from dniasync.train.sandblaster_queue import PortionQueue

# -- the Rust kernels ------------------------------------------------------------------------------


def test_vector_kernels_match_numpy_and_check_their_arguments() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=1001), rng.normal(size=1001)
    assert _core.vec_dot(a, b) == pytest.approx(float(a @ b), rel=1e-12)
    assert _core.vec_dots([a, b], [b, b]) == pytest.approx([float(a @ b), float(b @ b)], rel=1e-12)
    y = b.copy()
    _core.vec_axpy(0.5, a, y)
    np.testing.assert_allclose(y, b + 0.5 * a, rtol=1e-15)
    _core.vec_scale(-2.0, y)
    np.testing.assert_allclose(y, -2.0 * (b + 0.5 * a), rtol=1e-15)
    out = np.empty_like(a)
    _core.vec_add_scaled(out, a, 3.0, b)
    np.testing.assert_array_equal(out, a + 3.0 * b)
    _core.vec_lincomb(out, [2.0, -1.0], [a, b])
    np.testing.assert_allclose(out, 2.0 * a - b, rtol=1e-15, atol=1e-15)
    total, biggest = _core.vec_abs_sum_max(a)
    assert total == pytest.approx(float(np.abs(a).sum()), rel=1e-12) and biggest == float(np.abs(a).max())
    with pytest.raises(ValueError, match="expected 1001"):
        _core.vec_dot(a, b[:-1])
    with pytest.raises(TypeError, match="float64"):
        _core.vec_dot(a.astype(np.float32), b)
    with pytest.raises(ValueError):
        _core.vec_lincomb(out, [1.0], [a, b])


# -- the driver against the references ---------------------------------------------------------------


def softmax_problem(n: int = 400, features: int = 30, classes: int = 4) -> tuple[Any, np.ndarray]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, features, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=gen)
    n_w = classes * features

    def objective(v: np.ndarray) -> tuple[float, np.ndarray]:
        w = torch.tensor(v, requires_grad=True)
        loss = F.cross_entropy(x @ w[:n_w].view(classes, features).T + w[n_w:], y) + 1e-3 * (w * w).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        assert w.grad is not None
        return float(loss.detach()), w.grad.numpy().copy()

    x0 = np.random.default_rng(2).normal(size=n_w + classes) * 0.3
    return objective, x0


def test_the_reference_follows_torch_lbfgs_where_their_rules_coincide() -> None:
    objective, x0 = softmax_problem()
    w = torch.tensor(x0, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=15, max_eval=1000, history_size=4, tolerance_grad=1e-12,
                            tolerance_change=1e-14)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss, grad = objective(w.detach().numpy())
        w.grad = torch.from_numpy(grad)
        return torch.tensor(loss, dtype=torch.float64)

    opt.step(closure)  # type: ignore[no-untyped-call]
    settings = LBFGSSettings(history=4, max_iterations=15, line_search="none", tolerance_grad=1e-12,
                             tolerance_change=1e-14)
    x, result = reference_lbfgs(objective, x0, settings)
    assert result.iterations == 15
    np.testing.assert_allclose(x, w.detach().numpy(), rtol=1e-9, atol=1e-12)
    assert not np.allclose(x, x0, atol=1e-3)  # it moved


@pytest.mark.parametrize("line_search", ["none", "backtracking"])
def test_the_vector_free_driver_on_three_shards_gives_the_reference_iterates(line_search: str) -> None:
    objective, x0 = softmax_problem()
    settings = LBFGSSettings(history=3, max_iterations=25, line_search=line_search, lr=1.5,  # type: ignore[arg-type]
                             tolerance_grad=1e-12, tolerance_change=1e-14)
    x_ref, ref = reference_lbfgs(objective, x0, settings)
    group = LocalGroup(objective, x0, 3)
    result = asyncio.run(VectorFreeLBFGS(group, settings).run())
    assert result.iterations == ref.iterations == 25  # beyond the history: pairs were dropped
    assert result.line_search_evals == ref.line_search_evals
    if line_search == "backtracking":
        assert sum(ref.line_search_evals) > ref.iterations  # lr 1.5 overshoots: the line search worked
    np.testing.assert_allclose(group.x(), x_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-10)
    assert all(len(s.s) <= 3 + 1 for s in group.shards)  # the history, and the newest pair until it is judged


# -- the work queue --------------------------------------------------------------------------------------


def test_a_portion_computed_twice_is_committed_once_and_a_refused_push_returns_its_other_portions() -> None:
    q = PortionQueue(4, backup_threshold=0.5)
    q.start(0)
    got_a = [q.next_for("a")[0], q.next_for("a")[0]]
    got_b = [q.next_for("b")[0], q.next_for("b")[0]]
    assert sorted(got_a + got_b) == [0, 1, 2, 3]
    assert q.commit("b", 1, got_b, [1.0, 1.0])
    assert q.next_for("b") == (got_a[0], True)  # queue empty, half committed: a backup copy of a's work
    assert q.keep("b", got_a[0])
    assert q.commit("b", 2, [got_a[0]], [2.0])
    assert not q.keep("a", got_a[0])  # a's copy of it is dropped
    assert not q.commit("a", 1, got_a, [5.0, 5.0])  # names a committed portion: refused whole
    assert got_a[1] in q.pending and not q.complete
    assert q.next_for("b")[0] == got_a[1]
    assert q.commit("b", 3, [got_a[1]], [3.0])
    assert q.complete and q.loss_sum() == 7.0
    replicas, seqs = q.keys()
    assert sorted(zip(replicas, seqs)) == [("b", 1), ("b", 2), ("b", 3)]
    assert q.reissued >= 2 and q.duplicates_dropped >= 1


def test_a_dead_replicas_portions_go_back_and_no_backups_below_the_threshold() -> None:
    q = PortionQueue(4, backup_threshold=1.0)
    q.start(0)
    mine = [q.next_for("a")[0] for _ in range(4)]
    assert q.next_for("b") == (IDLE, True)  # nothing pending, backups disabled
    assert q.drop("a") == 4
    assert sorted(q.next_for("b")[0] for _ in range(4)) == sorted(mine)
    assert q.reissued == 4


# -- whole jobs in real processes ---------------------------------------------------------------------

JOB = """
[job]
name = "{name}"
mode = "sandblaster"
seed = 3
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = {sizes} }}

[data]
dataset = "mnist5k"
n_train = {n_train}
n_test = 500

[optimizer]
name = "sgd"
lr = 1.0

[sandblaster]
n_replicas = 2
n_ps_shards = 2
history = {history}
max_iterations = {iterations}
portion_size = {portion}
push_every = 3
backup_threshold = {backup}

[stop]
max_epochs = 100000
max_seconds = 600

[eval]
every_seconds = 2.0
"""


def write_job(tmp_path: Path, name: str, *, sizes: str = "[784, 10]", n_train: int = 4000, history: int = 10,
              iterations: int = 20, portion: int = 100, backup: float = 0.5) -> tuple[Path, Path]:
    out = tmp_path / name
    config = tmp_path / f"{name}.toml"
    config.write_text(JOB.format(name=name, out=out, sizes=sizes, n_train=n_train, history=history,
                                 iterations=iterations, portion=portion, backup=backup))
    return config, out


def launch(config: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(launcher: subprocess.Popen[str], out: Path, timeout: float = 600) -> dict[str, Any]:
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return finished(subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr), out)


def finished(proc: subprocess.CompletedProcess[str], out: Path) -> dict[str, Any]:
    """The summary of a job that ended: it exited 0, L-BFGS having run all its iterations."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"] == "L-BFGS stopped: max_iterations", doc["stop_reason"]
    return doc


def reference(config_path: Path) -> tuple[np.ndarray, list[float]]:
    """The single-process reference L-BFGS on the job's model, data and settings."""
    torch.set_num_threads(1)
    config = load_config(config_path)
    model = model_spec(config).build().double()
    params = list(model.parameters())
    x, y, _, _ = data_spec(config).load_split()
    x = x.double()

    def objective(v: np.ndarray) -> tuple[float, np.ndarray]:
        torch.nn.utils.vector_to_parameters(torch.from_numpy(v.copy()), params)
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params)
        return float(loss.detach()), torch.cat([g.reshape(-1) for g in grads]).numpy().copy()

    x0 = torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy()
    s = config.settings
    settings = LBFGSSettings(s.history, s.max_iterations, s.lr, s.line_search, s.armijo, s.max_line_search,
                             s.tolerance_grad, s.tolerance_change)
    final, result = reference_lbfgs(objective, x0, settings)
    return final, result.losses


def assert_same_iterates(out: Path, doc: dict[str, Any], config: Path) -> None:
    want, losses = reference(config)
    got = np.load(out / PARAMS_FILE)
    assert doc["metrics"]["iterations"] == 20
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel <= 1e-4, rel
    got_losses = [float(v) for v in doc["metrics"]["train_losses"].split(",")]
    np.testing.assert_allclose(got_losses, losses, rtol=1e-6)


def iterations_logged(out: Path) -> int:
    log = out / "logs" / "coordinator0.log"
    if not log.exists():
        return 0
    lines = [line for line in log.read_text().splitlines() if "L-BFGS iteration " in line]
    return int(lines[-1].split("L-BFGS iteration ")[1].split(":")[0]) if lines else 0


def wait_iterations(out: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while iterations_logged(out) < n:
        assert time.monotonic() < deadline, f"fewer than {n} L-BFGS iterations in {timeout} s"
        time.sleep(0.05)


def workers(out: Path) -> list[dict[str, Any]]:
    return [c for c in json.loads((out / "cluster.json").read_text())["children"] if c["role"] == "worker"]


Undisturbed = dict[str, tuple[subprocess.CompletedProcess[str], Path, Path]]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Undisturbed:
    """The two jobs nothing is done to, launched together (their results are iterates and byte counts, the same
    however fast they run; their start-ups overlap): ``{name: (launcher, config, out)}``."""
    tmp = tmp_path_factory.mktemp("sandblaster")
    jobs = {
        "exact": write_job(tmp, "exact"),
        # 784 -> 1270 -> 10: 1,009,660 parameters; a full history of 4 pairs is reached by iteration 5
        "traffic": write_job(tmp, "traffic", sizes="[784, 1270, 10]", n_train=200, history=4, iterations=6,
                             portion=50),
    }
    done = launch_two_at_a_time({name: config for name, (config, _) in jobs.items()})
    return {name: (done[name], config, out) for name, (config, out) in jobs.items()}


def test_two_shards_and_two_replicas_give_the_single_process_iterates(undisturbed: Undisturbed) -> None:
    proc, config, out = undisturbed["exact"]
    doc = finished(proc, out)
    assert_same_iterates(out, doc, config)
    m = doc["metrics"]
    assert m["evaluations"] >= 21 and m["line_search_evals"] >= 20
    # the coordinator sends commands and receives scalars: far fewer bytes than one parameter vector
    assert 0 < m["coordinator_bytes_per_iteration"] < m["param_vector_bytes"]
    assert doc["history"] and doc["final_accuracy"] > 0.8
    assert (out / "accuracy.png").exists()


def test_coordinator_bytes_per_iteration_stay_below_one_percent_of_a_1m_parameter_vector(
        undisturbed: Undisturbed) -> None:
    proc, _, out = undisturbed["traffic"]
    doc = finished(proc, out)
    m = doc["metrics"]
    assert m["param_vector_bytes"] == 8 * 1_009_660
    assert m["coordinator_bytes_per_iteration"] <= 0.01 * m["param_vector_bytes"], m
    print(f"coordinator bytes per iteration: {m['coordinator_bytes_per_iteration']:.0f} "
          f"({m['coordinator_bytes_per_iteration'] / m['param_vector_bytes']:.5%} of the parameter vector)")


def test_a_replica_killed_mid_batch_has_its_portions_reissued_and_the_iterates_do_not_change(tmp_path: Path) -> None:
    # no backup tasks: the killed replica's portions can only come back through the queue
    config, out = write_job(tmp_path, "kill", sizes="[784, 32, 10]", portion=50, backup=1.0)
    launcher = launch(config)
    try:
        wait_iterations(out, 3)
        victim = workers(out)[0]
        os.kill(victim["pid"], signal.SIGKILL)
        doc = finish(launcher, out)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    gone = [e for e in doc["events"] if e["kind"] == "sandblaster_replica_gone"]
    assert gone, doc["events"]
    assert_same_iterates(out, doc, config)


def test_a_replica_frozen_mid_batch_is_backed_up_and_nothing_is_counted_twice(tmp_path: Path) -> None:
    config, out = write_job(tmp_path, "freeze", sizes="[784, 32, 10]", portion=50, backup=0.5)
    launcher = launch(config)
    try:
        wait_iterations(out, 3)
        victim = workers(out)[0]
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            frozen_at = iterations_logged(out)
            wait_iterations(out, min(frozen_at + 3, 20))  # batches complete while it is frozen
        finally:
            os.kill(victim["pid"], signal.SIGCONT)
        doc = finish(launcher, out)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert doc["metrics"]["portions_reissued"] > 0
    assert_same_iterates(out, doc, config)
