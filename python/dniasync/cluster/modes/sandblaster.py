"""Sandblaster L-BFGS (Dean et al. 2012): batch L-BFGS with its vector work on the PS shards.

The flat parameter vector (float64) is cut into ``n_ps_shards`` contiguous
ranges, each a :class:`~dniasync.train.sandblaster.SandblasterShard` that
also holds its slice of the gradient, the direction and the ``(s, y)``
history. The coordinator node runs a
:class:`~dniasync.train.sandblaster_queue.SandblasterCoordinator`: the
vector-free L-BFGS driver (commands out, scalars back) and the work queue that
hands out the portions of each full-batch gradient to the replicas, with
backup tasks near the end of a batch. ``[optimizer]`` is not used: the step
comes from L-BFGS and its line search. With ``ps_replicas = R > 1`` each
shard has R copies (:mod:`._sandblaster_copies`), commanded in step by the
coordinator, so a copy's death loses nothing.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from msgspec import Meta

from ...actors import ActorError, ActorRef, Directive
from ...train.messages import StopTraining
from ...train.sandblaster import Fetch, SandblasterReplicaSpec, SandblasterShardSpec, Slice
from .._schema import ConfigError, Section
from ..mode_api import Hoster, JobFailed, Snapshot
from ..panels import Panel
from ..plan import data_spec, model_spec, schedule_spec
from ..protocol import Assignment, JoinJob, NoJob, Ready
from ._data_parallel import DataParallelMode, replica_name

if TYPE_CHECKING:
    from torch import nn

    from ...train.checkpoint import LoadedCheckpoint, Part
    from ...train.messages import Progress
    from ..config import Config
    from ..hosts import Host
    from ..mode_api import Runner
    from ..report import RunReport

__all__ = ["SANDBLASTER", "SandblasterConfig", "COORDINATOR_NAME", "PARAMS_FILE"]

COORDINATOR_NAME = "sandblaster"
"""The coordinator actor's name on the coordinator node."""
PARAMS_FILE = "sandblaster_params.npy"
"""The final parameters (float64), written next to the summary."""
EVENT_REPLICA_GONE = "sandblaster_replica_gone"
EVENT_SAMPLE = "batch_size"
"""The sample L-BFGS works on changed size (a ``[schedule]``): ``iteration``, ``batch_size``."""


class SandblasterConfig(Section, frozen=True):
    """Batch L-BFGS driven by the coordinator, vector work on the PS shards (mode `sandblaster`)."""

    n_replicas: Annotated[int, Meta(ge=1, description="worker processes computing portions of each batch gradient")] = 2
    n_ps_shards: Annotated[int, Meta(ge=1, description=(
        "the flat parameter vector (and the L-BFGS history) is cut into this many contiguous ranges"))] = 2
    history: Annotated[int, Meta(ge=1, description="L-BFGS history size (pairs (s, y) kept)")] = 10
    max_iterations: Annotated[int, Meta(ge=1, description="L-BFGS iterations before the job ends")] = 100
    tolerance_grad: Annotated[float, Meta(ge=0.0, description="stop when max |gradient| is at most this")] = 1e-7
    tolerance_change: Annotated[float, Meta(ge=0.0, description=(
        "stop when the step or the loss change is below this (torch.optim.LBFGS's rule)"))] = 1e-9
    lr: Annotated[float, Meta(gt=0.0, description=(
        "the first step tried (the first iteration's is min(1, 1/|g|_1) * lr, as in torch.optim.LBFGS)"))] = 1.0
    line_search: Annotated[Literal["backtracking", "none"], Meta(description=(
        "`backtracking`: halve the step until the Armijo condition holds; `none`: the fixed step lr"))] = "backtracking"
    armijo: Annotated[float, Meta(gt=0.0, lt=1.0, description="the Armijo constant c1")] = 1e-4
    max_line_search: Annotated[int, Meta(ge=1, description="function evaluations per line search at most")] = 20
    portion_size: Annotated[int, Meta(ge=1, description=(
        "examples per portion of the batch handed to a replica (keep it far below n_train / n_replicas)"))] = 100
    push_every: Annotated[int, Meta(ge=1, description="a replica pushes its accumulated gradient every this many portions")] = 4
    backup_threshold: Annotated[float, Meta(ge=0.0, le=1.0, description=(
        "once the queue is empty and this fraction of portions is committed, idle replicas get copies of "
        "the outstanding ones (backup tasks); 1 disables them"))] = 0.5
    silence_s: Annotated[float, Meta(gt=0.0, description=(
        "a replica silent this long loses its portions to the queue (a dead node's sooner)"))] = 20.0
    ps_replicas: Annotated[int, Meta(ge=1, description=(
        "copies of each PS shard, each in a PS process of its own: the coordinator sends every command to every "
        "live copy in the same order and replicas stage each push on every one before they commit it, so a copy's "
        "death loses nothing (a restarted copy takes a live copy's state before the next batch). 1: one copy; "
        "the job fails if it dies"))] = 1


def _measure(value: Any, reply: bool) -> int:
    """Bytes a command (or a reply) to a shard takes on the wire: the remote codec's frame, payload included."""
    from ...remote import encode
    from ...remote._codec import OP_ASK, OP_REPLY

    op = OP_REPLY if reply else OP_ASK
    encoded = encode(op, "sandblaster-ps-0@127.0.0.1:65535", 1, value, sender=f"{COORDINATOR_NAME}@127.0.0.1:65535")
    return len(encoded.single(op))


async def host_shard(host: Host, spec: SandblasterShardSpec) -> list[ActorRef]:
    from ...train.sandblaster import SandblasterShard

    return [await host.spawn(SandblasterShard, spec, name=f"sandblaster-ps-{spec.shard}", supervision=Directive.STOP)]


async def host_replica(host: Host, spec: SandblasterReplicaSpec) -> list[ActorRef]:
    from ...train.sandblaster import SandblasterReplica

    return [await host.spawn(SandblasterReplica, spec, incarnation=host.incarnation,
                             name=replica_name(host.ref.address), supervision=Directive.STOP)]


class _SandblasterJob:
    def __init__(self, config: Config, runner: Runner) -> None:
        import torch

        from ...train.flat import FlatModel, flatten_parameters, split_ranges
        from ...train.lbfgs import LBFGSSettings
        from ...train.sandblaster_queue import Board

        torch.set_num_threads(1)
        self.config, self.runner = config, runner
        self.settings: SandblasterConfig = config.settings
        s = self.settings
        self.model_spec, self.data_spec = model_spec(config), data_spec(config)
        model: nn.Module = self.model_spec.build()
        self.initial = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]).numpy().copy()
        self.n_params = int(self.initial.size)
        self.ranges = split_ranges(self.n_params, s.n_ps_shards)
        _, self.x_test, self.y_test = self.data_spec.open_split()  # a converted set stays mapped
        self.eval_buffer = flatten_parameters(model)
        self.eval_flat = FlatModel(model, self.eval_buffer)
        self.lbfgs = LBFGSSettings(s.history, s.max_iterations, s.lr, s.line_search, s.armijo, s.max_line_search,
                                   s.tolerance_grad, s.tolerance_change)
        self.board = Board(silence_limit_s=s.silence_s, on_dead=self._replica_gone)
        self.replicas: dict[str, str] = {}
        self.coordinator: ActorRef | None = None
        self._sizes_reported = 0
        node = runner.ref.address.partition("@")[2]
        self.coordinator_address = f"{COORDINATOR_NAME}@{node}"

    def ps_shards(self) -> list[Any]:
        return [SandblasterShardSpec(k, offset, self.initial[offset:offset + length].copy())
                for k, (offset, length) in enumerate(self.ranges)]

    def _shard_refs(self) -> list[ActorRef]:
        return [ref for ref in self.runner.ps if ref is not None]

    def live_copies(self) -> list[list[tuple[ActorRef, int]]]:
        """Each shard's live copies with their incarnations (the coordinator commands those): here, one each."""
        return [[(ref, 0)] for ref in self._shard_refs()]

    def assign(self, join: JoinJob) -> Assignment | NoJob:
        # any worker that joins takes work (a restarted one too): the queue gives each what it can do
        self.replicas[replica_name(join.member)] = "alive"
        return Assignment(SandblasterReplicaSpec(
            self.model_spec, self.data_spec, self._shard_refs(), [offset for offset, _ in self.ranges],
            self.coordinator_address, self.settings.portion_size, self.settings.push_every))

    async def ready(self, ready: Ready) -> None:
        from ...train.sandblaster_queue import SandblasterCoordinator

        if not ready.refs:
            return
        name = replica_name(ready.member)
        self.board.replica_refs[name] = ready.refs[0]
        self.replicas[name] = "alive"
        if self.coordinator is None:
            self.coordinator = await self.runner.system.spawn(
                SandblasterCoordinator, self._shard_refs(), self.lbfgs, self.config.data.n_train,
                self.settings.portion_size, self.settings.backup_threshold, self.board, _measure,
                schedule_spec(self.config), self.live_copies, name=COORDINATOR_NAME, supervision=Directive.STOP)
            self.runner.mark_started()

    def _replica_gone(self, name: str, returned: int) -> None:
        self.replicas[name] = "dead"
        self.runner.event(EVENT_REPLICA_GONE, replica=name, portions_returned=returned)

    def progress(self, msg: Progress) -> None:
        return

    def check(self, now: float) -> None:
        if self.config.schedule.kind != "fixed":
            for iteration, size in self.board.sample_sizes[self._sizes_reported:]:
                self.runner.event(EVENT_SAMPLE, iteration=iteration, batch_size=size)
            self._sizes_reported = len(self.board.sample_sizes)
        if self.board.error is not None:
            raise JobFailed(f"Sandblaster L-BFGS failed: {self.board.error}", "sandblaster_failed")
        for name in self.replicas:
            self.replicas[name] = "dead" if name in self.board.dead else "alive"

    def samples(self) -> int:
        return self.board.examples

    def steps(self) -> int:
        return self.board.iterations

    def done(self) -> str | None:
        return self.board.stop_reason

    def members(self) -> dict[str, str]:
        return dict(self.replicas)

    def _figures(self) -> dict[str, Any]:
        b, q = self.board, self.board.queue
        per_iteration = b.command_bytes / b.iterations if b.iterations else 0.0
        return {
            "iterations": b.iterations, "train_loss": b.loss, "evaluations": b.evaluations,
            "line_search_evals": b.line_search_evals,
            "portions_reissued": q.reissued if q else 0, "backup_tasks": q.backups if q else 0,
            "duplicates_dropped": q.duplicates_dropped if q else 0,
            "commits_refused": q.commits_refused if q else 0,
            "coordinator_command_bytes": b.command_bytes, "coordinator_bytes_per_iteration": per_iteration,
            "coordinator_scalars_received": b.command_scalars,
            "param_vector_bytes": self.n_params * 8,
            "sample_size": b.sample_size, "epochs": b.examples / self.config.data.n_train,
        }

    def extra(self) -> dict[str, Any]:
        b = self.board
        figures = {k: v for k, v in self._figures().items() if not (isinstance(v, float) and math.isnan(v))}
        loss = f"{figures['train_loss']:.5g}" if "train_loss" in figures else "-"
        figures["lbfgs"] = (  # the live page's line
            f"iteration {figures['iterations']} · training loss {loss} · {figures['evaluations']} batch gradients "
            f"({figures['line_search_evals']} in line searches) · {figures['portions_reissued']} portions reissued "
            f"({figures['backup_tasks']} backup tasks, {figures['duplicates_dropped']} duplicates dropped) · "
            f"{figures['coordinator_bytes_per_iteration']:,.0f} coordinator bytes per iteration"
            + (f" · sample {b.sample_size:,} examples" if self.config.schedule.kind != "fixed" else ""))
        return figures

    async def _params(self) -> np.ndarray:
        async def fetch(copies: list[ActorRef]) -> Slice:
            """From the first copy that answers (the coordinator commands each of them)."""
            for ref in copies[:-1]:
                try:
                    reply = await ref.ask(Fetch(-1), timeout=self.config.eval.timeout_s)
                except ActorError:
                    continue
                if isinstance(reply, Slice):
                    return reply
            reply = await copies[-1].ask(Fetch(-1), timeout=self.config.eval.timeout_s)
            if not isinstance(reply, Slice):
                raise ActorError(f"{copies[-1].address}: {reply!r}")
            return reply

        commanded = self.board.commanded or [[ref] for ref in self._shard_refs()]
        replies = await asyncio.gather(*(fetch(row) for row in commanded if row))
        out = np.empty(self.n_params, dtype=np.float64)
        for reply in replies:
            offset, length = self.ranges[reply.shard]
            out[offset:offset + length] = reply.values
        return out

    async def snapshot(self) -> Snapshot:
        return Snapshot(await self._params())

    async def score(self, snapshot: Snapshot) -> tuple[float, float]:
        from ...train.flat import evaluate

        np.copyto(self.eval_buffer, snapshot.weights.astype(np.float32))
        return await self.runner.run_blocking(evaluate, self.eval_flat.model, self.x_test, self.y_test,
                                             threads=snapshot.threads)

    async def stop(self, reason: str) -> None:
        self.board.stopping = True
        for ref in self.board.replica_refs.values():
            try:
                ref.tell_nowait(StopTraining(reason))
            except ActorError:
                pass

    async def record(self, report: RunReport) -> None:
        from ...train.flat import model_arrays

        report.set_final_weights(model_arrays(self.eval_flat.model))  # the weights the last evaluation scored
        for key, value in self._figures().items():
            if isinstance(value, float) and not math.isfinite(value):
                continue
            report.set_metric(key, value)
        b = self.board
        report.set_metric("train_losses", ",".join(f"{v:.17g}" for v in b.losses))
        report.set_metric("iteration_walls", ",".join(f"{v:.4f}" for v in b.walls))
        report.set_metric("batch_seconds", ",".join(f"{v:.4f}" for v in b.batch_seconds))
        report.set_metric("batch_end_unix", ",".join(f"{v:.4f}" for v in b.batch_ends_unix))
        report.set_metric("sample_sizes", ",".join(f"{i}:{m}" for i, m in b.sample_sizes))
        try:
            params = await self._params()
        except ActorError:
            return
        path = Path(self.config.output_dir)
        path.mkdir(parents=True, exist_ok=True)
        await self.runner.run_blocking(np.save, path / PARAMS_FILE, params)

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, Part]]:
        return {"iterations": self.board.iterations}, {}

    def restore(self, loaded: LoadedCheckpoint) -> None:
        raise JobFailed("a Sandblaster job cannot resume (its L-BFGS history lives in the shards' memory)",
                        "resume_refused")

    async def close(self) -> None:
        if self.coordinator is not None:
            try:
                await self.runner.system.stop(self.coordinator)
            except ActorError:
                pass


class _Sandblaster(DataParallelMode):
    name = "sandblaster"
    settings = SandblasterConfig
    shards_key = "sandblaster.n_replicas"
    worker_kind = "replica"
    schedules = True

    def data_shards(self, settings: SandblasterConfig) -> int:
        return 1  # every replica reads the whole training set; the work queue splits it

    def syncs(self, settings: SandblasterConfig) -> tuple[str, ...]:
        return ("ps",)  # the L-BFGS vector operations run on the PS shards

    def check(self, config: Config, raw: Mapping[str, Any]) -> None:
        s: SandblasterConfig = config.settings
        if s.portion_size > config.data.n_train:
            raise ConfigError(f"'sandblaster.portion_size' is {s.portion_size}, more than data.n_train = "
                              f"{config.data.n_train}", "sandblaster.portion_size")

    def resolve(self, config: Config, model: nn.Module) -> None:
        from ...train.models import count_parameters

        n_params, shards = count_parameters(model), config.settings.n_ps_shards
        if shards > n_params:
            raise ConfigError(f"'sandblaster.n_ps_shards' is {shards}, but the model has only {n_params} parameters",
                              "sandblaster.n_ps_shards")

    def processes(self, config: Config) -> tuple[int, int]:
        return config.settings.n_ps_shards * config.settings.ps_replicas, config.settings.n_replicas

    def summary_lines(self, config: Config, doc: Mapping[str, Any]) -> list[str]:
        doc = doc.get("metrics", {})
        return [f"  L-BFGS iterations  {doc.get('iterations', 0)} ({doc.get('evaluations', 0)} batch gradients, "
                f"{doc.get('line_search_evals', 0)} line-search evaluations)",
                f"  portions reissued  {doc.get('portions_reissued', 0)} (backup tasks {doc.get('backup_tasks', 0)}, "
                f"duplicates dropped {doc.get('duplicates_dropped', 0)})",
                f"  coordinator bytes  {doc.get('coordinator_bytes_per_iteration', 0):,.0f} per iteration",
                *([f"  PS shard copies    {doc.get('ps_copies_lost', 0)} lost, {doc.get('ps_copies_rejoined', 0)} "
                   f"rejoined ({doc.get('ps_copy_transfers', 0)} states transferred), identical at the end: "
                   f"{'yes' if doc.get('ps_copies_identical') else 'no'}"] if "ps_copies_identical" in doc else []),
                *([f"  sample             {doc.get('sample_size', 0):,} examples (iteration:size "
                   f"{doc['sample_sizes']})"] if "," in str(doc.get("sample_sizes", "")) else [])]

    def panels(self, config: Config) -> tuple[Panel, ...]:
        return ()  # its progress is the L-BFGS line the status carries (``lbfgs``)

    def job(self, config: Config, runner: Runner) -> _SandblasterJob:
        if config.settings.ps_replicas > 1:
            from ._sandblaster_copies import ReplicatedSandblasterJob

            return ReplicatedSandblasterJob(config, runner)
        return _SandblasterJob(config, runner)

    def hosters(self) -> dict[type, Hoster]:
        return {SandblasterShardSpec: host_shard, SandblasterReplicaSpec: host_replica}


SANDBLASTER = _Sandblaster()
