"""Pipelines: synthetic gradients, stage actors and their update rules, the pipeline driver.

Everything runs in one ActorSystem with the stages talking only through refs
and wire messages, as they would across processes.
"""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from dniasync import Actor, ActorSystem, handler
from dniasync.train.pipeline import (
    Connect,
    Done,
    Forward,
    Gradient,
    GroupConfigError,
    LossReport,
    PipelineBroken,
    PipelineDriver,
    Schedule,
    Stage,
    StageDown,
    StageSettings,
    StageShape,
    StatsRequest,
    SyntheticGradient,
    Trace,
    TraceRequest,
    batch_order,
    build_stages,
    get_rule,
    run_pipeline,
    spawn_stages,
    split_sequential,
    train_backprop,
    validate_groups,
)
from dniasync.train.pipeline.rules import CDNIRule
from dniasync.train.pipeline.synthetic import AGREEMENT_DECAY

torch.set_num_threads(1)

GROUPS = [[0, 1], [2, 3], [4]]


def mlp(seed: int = 0, d_in: int = 64, width: int = 64) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1400], perm[1400:]
    return x[train], y[train], x[test], y[test]


# -- the synthetic-gradient model ------------------------------------------------------


@pytest.mark.parametrize("hidden_layers", [0, 1, 2])
@pytest.mark.parametrize("num_classes", [0, 10])
def test_synthetic_gradient_is_exactly_zero_before_training(hidden_layers: int, num_classes: int) -> None:
    sg = SyntheticGradient(16, num_classes=num_classes, hidden_layers=hidden_layers, hidden_width=8)
    h = torch.randn(5, 16)
    labels = torch.arange(5)
    assert torch.equal(sg(h, labels), torch.zeros(5, 16))
    sg.fit(h, labels, torch.ones(5, 16))
    assert sg(h, labels).abs().sum() > 0  # one step moves it: the zero above was not a constant


def test_synthetic_gradient_training_reduces_its_loss() -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(8, 8, generator=gen) * 0.1
    h = torch.randn(64, 8, generator=gen)
    target = h @ a
    sg = SyntheticGradient(8, hidden_layers=1, hidden_width=32, lr=1e-2)
    for _ in range(200):
        sg.fit(h, None, target)
    assert len(sg.losses) == 200 and sg.steps == 200
    assert sg.losses[-1] < 0.05 * sg.losses[0]


def test_conditioned_synthetic_gradient_uses_the_labels() -> None:
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(400, 6, generator=gen)
    labels = torch.randint(0, 4, (400,), generator=gen)
    per_class = torch.randn(4, 6, generator=gen)
    target = per_class[labels]  # depends on the label only: invisible to a plain SG
    plain = SyntheticGradient(6, hidden_layers=0, lr=1e-2)
    conditioned = SyntheticGradient(6, num_classes=4, hidden_layers=0, lr=1e-2)
    for _ in range(300):
        plain.fit(h, None, target)
        conditioned.fit(h, labels, target)
    assert conditioned.losses[-1] < 0.05
    assert plain.losses[-1] > 0.5
    with pytest.raises(ValueError, match="needs the labels"):
        conditioned(h, None)


# -- cutting models into groups --------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "problem"),
    [
        ([], "no stages given"),
        ([[0, 1], [], [2, 3, 4]], "group 1 is empty"),
        ([[0, 1], [3, 4]], r"layers \[2\] are in no group"),
        ([[0, 1, 2], [2, 3, 4]], "layer 2 is in group 0 and in group 1"),
        ([[0, 1, 1], [2, 3, 4]], "layer 1 is twice in group 0"),
        ([[0, 1], [2, 3], [4, 5]], "group 2: layer 5 is out of range"),
        ([[-1, 0], [1, 2, 3, 4]], "group 0: layer -1 is out of range"),
        ([[0, 2], [1, 3, 4]], r"group 0 \[0, 2\] is not a contiguous"),
        ([[2, 3, 4], [0, 1]], "groups are out of order"),
        ([[0, 1], ["2", 3, 4]], "'2' is not an integer"),
    ],
)
def test_bad_group_configs_fail_naming_the_problem(groups: list[list[int]], problem: str) -> None:
    with pytest.raises(GroupConfigError, match=problem):
        validate_groups(groups, 5)


async def test_bad_config_fails_at_start_before_any_group_runs() -> None:
    async with ActorSystem() as system:
        with pytest.raises(GroupConfigError, match="in no group"):
            await spawn_stages(system, mlp(), [[0, 1], [2, 3]], StageSettings(), 64)
        assert system.actors() == []


async def test_unknown_rule_is_rejected_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown update rule 'pipedream'; known rules: 'dni', 'cdni', 'sync', 'async', "
                                         "'stash', 'spectrain'"):
        get_rule("pipedream")
    async with ActorSystem() as system:
        with pytest.raises(ValueError, match="unknown update rule 'gpipe'"):
            await spawn_stages(system, mlp(), GROUPS, StageSettings(rule="gpipe"), 64)
        with pytest.raises(ValueError, match="synthetic inputs need the rule 'dni' or 'cdni'"):
            await spawn_stages(system, mlp(), GROUPS, StageSettings(rule="sync", synthetic_inputs=True), 64)
        assert system.actors() == []


def test_split_sequential_shares_the_layers() -> None:
    model = mlp()
    parts = split_sequential(model, GROUPS)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert parts[1][0] is model[2]
    specs = build_stages(model, GROUPS, StageSettings(), 64)
    shapes = [(s.shape.in_features, s.shape.out_features, s.shape.last) for s in specs]
    assert shapes == [(64, 64, False), (64, 64, False), (64, 10, True)]


# -- a stage in isolation, wired to a recorder ---------------------------------------


class Recorder(Actor):
    """Stands in for a stage's neighbours and monitor; keeps what it receives."""

    mailbox_size = 0

    def __init__(self) -> None:
        self.received: list[object] = []

    @handler(Forward, Gradient, Done, LossReport, StageDown)
    def keep(self, msg: object) -> None:
        self.received.append(msg)

    @handler
    def dump(self, msg: StatsRequest) -> list[object]:
        return list(self.received)


async def test_bootstrapped_target_is_next_groups_synthetic_gradient_backpropagated() -> None:
    """A middle stage sends upstream M_k(h_k) back-propagated through its layers (before its update)."""
    torch.manual_seed(3)
    layers = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 8))
    sg = SyntheticGradient(8, num_classes=10, hidden_layers=1, hidden_width=16)
    with torch.no_grad():  # give the SG model a non-zero output, as after some training
        for p in sg.parameters():
            p.normal_(0.0, 0.3)
    layers_before, sg_before = copy.deepcopy(layers), copy.deepcopy(sg)
    h = torch.randn(5, 12)
    labels = torch.tensor([0, 3, 9, 3, 1])

    async with ActorSystem() as system:
        rec = await system.spawn(Recorder, name="recorder")
        settings, shape = StageSettings(rule="cdni"), StageShape(12, 8, 12, last=False)
        group = await system.spawn(Stage, layers, settings, shape, rule=CDNIRule(settings, shape, sg=sg), name="g1")
        await group.ask(Connect([rec], [rec], rec))
        await group.tell(Forward(7, 7, 1, 1.0, h, labels))
        stats = await group.ask(StatsRequest())  # handled after the forward: its sends are in rec's mailbox
        received = await rec.ask(StatsRequest())

    assert stats.steps == 1
    forwards = [m for m in received if isinstance(m, Forward)]
    gradients = [m for m in received if isinstance(m, Gradient)]
    assert len(forwards) == 1 and len(gradients) == 1 and gradients[0].batch_id == 7

    h_in = h.clone().requires_grad_(True)
    h_out = layers_before(h_in)
    target = torch.autograd.grad(h_out, h_in, grad_outputs=sg_before(h_out.detach(), labels))[0]
    assert target.abs().sum() > 0
    torch.testing.assert_close(gradients[0].gradient, target)
    torch.testing.assert_close(forwards[0].activations, h_out.detach())
    # and the group did update itself from that synthetic gradient
    assert not torch.equal(layers.state_dict()["0.weight"], layers_before.state_dict()["0.weight"])


async def test_true_gradient_overtakes_queued_forwards_and_staleness_is_reported() -> None:
    """A returning gradient is fitted before the forwards already queued, so the SG learns from fresh outputs."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(12, 8))
    labels = torch.tensor([1, 2, 3])
    settings = StageSettings(rule="cdni", trace=True)
    async with ActorSystem() as system:
        rec = await system.spawn(Recorder, name="recorder")
        group = await system.spawn(Stage, layers, settings, StageShape(12, 8, 12, last=False), name="g0")
        await group.ask(Connect([], [rec], rec))
        await group.tell(Forward(0, 0, 1, 1.0, torch.randn(3, 12), labels))
        await group.ask(StatsRequest())
        # queued together while the group is idle: two forwards, then the gradient of batch 0
        await group.tell(Forward(1, 1, 1, 1.0, torch.randn(3, 12), labels))
        await group.tell(Forward(2, 2, 1, 1.0, torch.randn(3, 12), labels))
        await group.tell(Gradient(0, torch.randn(3, 8)))
        fresh = await group.ask(StatsRequest())
        await group.tell(Gradient(1, torch.randn(3, 8)))  # batch 2 went forward after batch 1
        stale = await group.ask(StatsRequest())
        trace = await group.ask(TraceRequest())

    assert isinstance(trace, Trace)
    handled = [(e, b) for e, b in zip(trace.events, trace.batch_ids) if e in ("forward", "gradient")]
    assert handled == [("forward", 0), ("gradient", 0), ("forward", 1), ("forward", 2), ("gradient", 1)]
    assert (fresh.sg_steps, fresh.sg_staleness_total) == (1, 0)
    assert (stale.sg_steps, stale.sg_staleness_total) == (2, 1)  # batch 1's fit came one update late


async def test_sg_fit_rows_fits_the_synthetic_gradient_on_the_first_rows_only() -> None:
    torch.manual_seed(1)
    layers = nn.Sequential(nn.Linear(12, 8))
    sg = SyntheticGradient(8, num_classes=10, hidden_layers=0, lr=1e-2)
    reference, everything = copy.deepcopy(sg), copy.deepcopy(sg)
    labels = torch.tensor([1, 2, 3, 4])
    target = torch.randn(4, 8)
    settings, shape = StageSettings(rule="cdni", sg_fit_rows=2), StageShape(12, 8, 12, last=False)
    async with ActorSystem() as system:
        rec = await system.spawn(Recorder, name="recorder")
        group = await system.spawn(Stage, layers, settings, shape, rule=CDNIRule(settings, shape, sg=sg), name="g0")
        await group.ask(Connect([], [rec], rec))
        await group.tell(Forward(0, 0, 1, 1.0, torch.randn(4, 12), labels))
        await group.ask(StatsRequest())
        await group.tell(Gradient(0, target))
        stats = await group.ask(StatsRequest())
        received = await rec.ask(StatsRequest())

    h_out = next(m for m in received if isinstance(m, Forward)).activations
    reference.fit(h_out[:2], labels[:2], target[:2])
    assert stats.sg_steps == 1
    for got, want in zip(sg.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    everything.fit(h_out, labels, target)  # all four rows would have moved it elsewhere
    assert not torch.allclose(everything.net[0].weight, sg.net[0].weight)


def test_synthetic_gradient_measures_its_agreement_with_the_true_gradient() -> None:
    """|M − g| / |g| is measured on the prediction a fit starts from; the gain is |g|² / |M − g|², at most 1."""
    torch.manual_seed(4)
    sg = SyntheticGradient(6, hidden_layers=0, lr=1e-2)
    h, target = torch.randn(5, 6), torch.randn(5, 6) * 0.1
    assert sg.gain == 1.0 and sg.relative_error != sg.relative_error  # nothing measured: NaN
    sg.fit(h, None, target)  # the prediction was zero: its error is the gradient itself
    assert sg.relative_error == pytest.approx(1.0) and sg.gain == pytest.approx(1.0)
    with torch.no_grad():
        for p in sg.parameters():
            p.normal_(0.0, 1.0)
    pred = sg(h).detach()
    d = AGREEMENT_DECAY
    want = math.sqrt(
        (float((pred - target).pow(2).sum()) + d * float(target.pow(2).sum()))
        / (d * float(target.pow(2).sum()) + float(target.pow(2).sum()))
    )
    sg.fit(h, None, target)
    assert sg.relative_error == pytest.approx(want, rel=1e-5)
    assert want > 2.0 and sg.gain == pytest.approx(1.0 / want**2, rel=1e-5)


async def test_synthetic_step_is_scaled_by_the_sg_models_gain() -> None:
    """A synthetic step moves the layers by lr · gain · gradient (plain SGD); the target sent upstream is unscaled."""
    torch.manual_seed(5)
    layers = nn.Sequential(nn.Linear(12, 8))
    sg = SyntheticGradient(8, num_classes=10, hidden_layers=0, lr=1e-2)
    with torch.no_grad():
        for p in sg.parameters():
            p.normal_(0.0, 1.0)
    h, labels = torch.randn(4, 12), torch.tensor([1, 2, 3, 4])
    sg.fit(layers(h).detach(), labels, torch.randn(4, 8) * 0.01)  # a poor model: gain well below 1
    gain = sg.gain
    assert 0.0 < gain < 0.5
    before, sg_before = copy.deepcopy(layers), copy.deepcopy(sg)
    settings, shape = StageSettings(rule="cdni", optimizer="sgd", lr=0.1), StageShape(12, 8, 12, last=False)
    async with ActorSystem() as system:
        rec = await system.spawn(Recorder, name="recorder")
        group = await system.spawn(Stage, layers, settings, shape, rule=CDNIRule(settings, shape, sg=sg), name="g1")
        await group.ask(Connect([rec], [rec], rec))
        await group.tell(Forward(0, 0, 1, 1.0, h, labels))
        await group.ask(StatsRequest())
        received = await rec.ask(StatsRequest())

    h_in = h.clone().requires_grad_(True)
    h_out = before(h_in)
    synthetic = sg_before(h_out.detach(), labels)
    h_out.backward(synthetic)
    for got, p in zip(layers.parameters(), before.parameters(), strict=True):
        assert p.grad is not None
        torch.testing.assert_close(got.detach(), p.detach() - 0.1 * gain * p.grad)
    upstream = next(m for m in received if isinstance(m, Gradient))
    assert h_in.grad is not None
    torch.testing.assert_close(upstream.gradient, h_in.grad)


# -- whole pipelines -----------------------------------------------------------------------


@pytest.mark.parametrize("micro_batches", [1, 3])
async def test_true_gradient_instead_of_synthetic_reproduces_backprop(
    digits: tuple[torch.Tensor, ...], micro_batches: int
) -> None:
    """The synchronous pipeline (the true gradient where DNI puts the synthetic one) = plain backprop."""
    x, y = digits[0][:256], digits[1][:256]
    reference = mlp(seed=5)
    train_backprop(reference, x, y, epochs=2, batch_size=32, seed=9, lr=1e-3)

    model = mlp(seed=5)
    untouched = copy.deepcopy(model)
    async with ActorSystem() as system:
        refs = await spawn_stages(system, model, GROUPS, StageSettings(rule="sync"), 64)
        schedule = Schedule(micro_batches=micro_batches, flush=True)
        async with PipelineDriver(system, refs, schedule) as driver:
            result = await driver.train(x, y, epochs=2, batch_size=32, seed=9)
            states = await driver.states()

    assert result.samples == 512
    assert [s.steps for s in result.stats] == [16, 16, 16]
    got = {
        f"{layer}.{name.split('.')[1]}": tensor
        for group, state in zip(GROUPS, states)
        for name, tensor in state.items()
        for layer in [group[int(name.split(".")[0])]]
    }
    want = reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert not torch.equal(want[key], untouched.state_dict()[key])
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


async def test_sync_rule_with_one_batch_in_flight_reproduces_backprop(digits: tuple[torch.Tensor, ...]) -> None:
    """No flush, no micro-batches: a window of one batch alone makes the true-gradient rule backprop."""
    x, y = digits[0][:192], digits[1][:192]
    reference = mlp(seed=6)
    train_backprop(reference, x, y, epochs=1, batch_size=32, seed=3, lr=1e-3)
    model = mlp(seed=6)
    batches = [idx for _, idx in batch_order(192, 32, epochs=1, seed=3)]  # what a data cursor would hand out
    async with ActorSystem() as system:
        refs = await spawn_stages(system, model, GROUPS, StageSettings(rule="sync"), 64)
        async with PipelineDriver(system, refs, Schedule(max_in_flight=1)) as driver:
            result = await driver.train(x, y, batches)
            states = await driver.states()
    assert result.samples == 192 and [s.steps for s in result.stats] == [6, 6, 6]
    got = {f"{g[int(n.split('.')[0])]}.{n.split('.')[1]}": t for g, st in zip(GROUPS, states) for n, t in st.items()}
    want = reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


async def test_drain_waits_for_every_batch_in_flight_then_rewire_drives_other_stages(
    digits: tuple[torch.Tensor, ...]
) -> None:
    x, y = digits[0], digits[1]
    async with ActorSystem() as system:
        refs = await spawn_stages(system, mlp(), GROUPS, StageSettings(), 64)
        others = await spawn_stages(system, mlp(seed=1), [[0, 1, 2, 3], [4]], StageSettings(), 64, prefix="other")
        async with PipelineDriver(system, refs, Schedule(max_in_flight=6)) as driver:
            training = asyncio.create_task(driver.train(x, y, epochs=100, batch_size=16))
            while (await refs[2].ask(StatsRequest())).steps < 10:
                pass
            training.cancel()  # the feeding stops with batches still in the pipeline
            with pytest.raises(asyncio.CancelledError):
                await training
            assert driver.in_flight > 0
            await driver.drain()
            assert driver.in_flight == 0
            first, _, last = await driver.stats()
            # every batch fed went through the last stage, and its true gradient came back to the first
            assert first.sg_steps == last.steps >= 10 and first.late_gradients == first.evictions == 0

            await driver.rewire(others)
            result = await driver.train(x[:64], y[:64], epochs=1, batch_size=16)
            assert [s.steps for s in result.stats] == [4, 4]
            assert (await refs[0].ask(StatsRequest())).steps == first.steps  # the old stages no longer train


@pytest.mark.parametrize("mode", ["dni", "sync"])
async def test_group_updates_before_any_gradient_returns(digits: tuple[torch.Tensor, ...], mode: str) -> None:
    """Traces recorded by the actors: in DNI stage 0 updates on every batch before its gradient is back."""
    x, y = digits[0][:128], digits[1][:128]
    settings = StageSettings(rule=mode, trace=True)
    async with ActorSystem() as system:
        refs = await spawn_stages(system, mlp(), GROUPS, settings, 64)
        async with PipelineDriver(system, refs, Schedule.for_rule(mode, max_in_flight=4)) as driver:
            await driver.train(x, y, epochs=1, batch_size=16, seed=0)
            traces = await driver.traces()

    first = list(zip(traces[0].events, traces[0].batch_ids))
    updates = [i for i, (e, _) in enumerate(first) if e == "update"]
    gradients = [i for i, (e, _) in enumerate(first) if e == "gradient"]
    assert len(updates) == 8 and len(gradients) == 8
    if mode == "dni":
        # stage 0 updated before any gradient came back (how many depends on timing: returning gradients
        # overtake queued forwards), and on every batch before that batch's gradient
        assert updates[0] < gradients[0]
        for b in range(8):
            assert first.index(("sent_downstream", b)) < first.index(("update", b)) < first.index(("gradient", b))
        middle = list(zip(traces[1].events, traces[1].batch_ids))
        for b in range(8):  # the middle stage sends its (bootstrapped) gradient right after updating
            assert middle.index(("update", b)) < middle.index(("sent_upstream", b)) < middle.index(("gradient", b))
    else:
        assert updates[0] > gradients[0]
        for b in range(8):
            assert first.index(("gradient", b)) < first.index(("update", b))


async def test_cache_evictions_are_counted_and_their_batches_still_finish() -> None:
    torch.manual_seed(0)
    labels = torch.tensor([1, 2, 3])
    async with ActorSystem() as system:
        rec = await system.spawn(Recorder, name="recorder")
        shape = StageShape(12, 8, 12, last=False)
        layers = nn.Sequential(nn.Linear(12, 8))
        group = await system.spawn(Stage, layers, StageSettings(cache_size=2), shape, name="g0")
        await group.ask(Connect([], [rec], rec))
        for b in range(3):  # the third output pushes the first out of the cache
            await group.tell(Forward(b, b, 1, 1.0, torch.randn(3, 12), labels))
        await group.ask(StatsRequest())  # the forwards are done (a queued gradient would overtake them)
        for b in range(3):
            await group.tell(Gradient(b, torch.randn(3, 8)))
        stats = await group.ask(StatsRequest())
        received = await rec.ask(StatsRequest())

    assert (stats.evictions, stats.late_gradients, stats.sg_steps) == (1, 1, 2)
    assert sorted(m.batch_id for m in received if isinstance(m, Done)) == [0, 1, 2]  # none left in flight


async def test_stopped_group_is_reported_not_hung(digits: tuple[torch.Tensor, ...]) -> None:
    x, y = digits[0], digits[1]
    async with ActorSystem() as system:
        refs = await spawn_stages(system, mlp(), GROUPS, StageSettings(), 64)
        async with PipelineDriver(system, refs, Schedule(max_in_flight=4)) as driver:
            training = asyncio.create_task(driver.train(x, y, epochs=100, batch_size=16))
            while (await refs[2].ask(StatsRequest())).steps < 5:  # progress seen through messages
                pass
            await system.stop(refs[1])
            async with asyncio.timeout(10):
                with pytest.raises(PipelineBroken) as err:
                    await training
    assert err.value.address == refs[1].address


async def test_failing_group_is_reported(digits: tuple[torch.Tensor, ...]) -> None:
    x, y = digits[0][:64], digits[1][:64]
    async with ActorSystem() as system:
        refs = await spawn_stages(system, mlp(), GROUPS, StageSettings(), 64)
        async with PipelineDriver(system, refs) as driver:
            async with asyncio.timeout(10):
                with pytest.raises(PipelineBroken, match="failed") as err:
                    await driver.train(x[:, :32], y, epochs=1, batch_size=16)  # wrong width for group 0
    assert err.value.address == refs[0].address


async def test_dni_on_digits_reaches_modest_accuracy(digits: tuple[torch.Tensor, ...]) -> None:
    xtr, ytr, xte, yte = digits
    settings = StageSettings(rule="cdni", lr=3e-4, sg_lr=1e-4, sg_hidden_layers=0)
    result = await run_pipeline(
        mlp(width=128), GROUPS, xtr, ytr, settings=settings, epochs=10, batch_size=32, eval_x=xte, eval_y=yte
    )
    assert result.samples == 10 * 1400
    assert len(result.history) == 10
    assert result.history[0].accuracy < result.final_accuracy
    assert result.final_accuracy >= 0.75, [p.accuracy for p in result.history]
    sg0 = [p.sg_losses[0] for p in result.history]
    assert all(v == v for v in sg0)  # recorded at every point (not NaN)


async def test_synthetic_inputs_train_the_input_model(digits: tuple[torch.Tensor, ...]) -> None:
    xtr, ytr, xte, yte = digits
    settings = StageSettings(rule="cdni", lr=3e-4, sg_hidden_layers=0, synthetic_inputs=True)
    result = await run_pipeline(
        mlp(), GROUPS, xtr, ytr, settings=settings, epochs=3, batch_size=50, eval_x=xte, eval_y=yte
    )
    first, middle, last = result.stats
    assert first.input_steps == 0
    assert middle.input_steps == last.input_steps == 84
    assert middle.steps == 168  # one update on the synthetic input, one on the real one, per batch
    start, end = result.history[0].input_losses, result.history[-1].input_losses
    assert end[1] < start[1] and end[2] < start[2]
    assert result.final_accuracy > 0.5


def test_batch_order_is_seeded() -> None:
    a = [idx.tolist() for _, idx in batch_order(10, 4, 2, seed=1)]
    b = [idx.tolist() for _, idx in batch_order(10, 4, 2, seed=1)]
    assert a == b and len(a) == 6 and len(a[2]) == 2
    assert sorted(sum(a[:3], [])) == list(range(10))


@pytest.mark.parametrize("synthetic_inputs", [False, True])
async def test_mailboxes_of_twice_the_window_never_deadlock(
    digits: tuple[torch.Tensor, ...], synthetic_inputs: bool
) -> None:
    """Forwards go down and gradients up through bounded mailboxes; the window keeps them from filling."""
    x, y = digits[0][:640], digits[1][:640]
    window = 3
    settings = StageSettings(synthetic_inputs=synthetic_inputs)
    async with ActorSystem() as system:
        mailbox_size = (3 if synthetic_inputs else 2) * window
        refs = await spawn_stages(system, mlp(), GROUPS, settings, 64, mailbox_size=mailbox_size)
        async with PipelineDriver(
            system, refs, Schedule(max_in_flight=window), synthetic_inputs=synthetic_inputs, stall_timeout_s=10
        ) as driver:
            async with asyncio.timeout(30):
                result = await driver.train(x, y, epochs=2, batch_size=8)
    assert [s.steps for s in result.stats] == [160, 320, 320] if synthetic_inputs else [160, 160, 160]


async def test_mailboxes_too_small_for_the_window_are_reported_not_hung(digits: tuple[torch.Tensor, ...]) -> None:
    x, y = digits[0][:640], digits[1][:640]
    settings = StageSettings(send_timeout_s=0.5)
    async with ActorSystem() as system:
        refs = await spawn_stages(system, mlp(), GROUPS, settings, 64, mailbox_size=1)
        async with PipelineDriver(system, refs, Schedule(max_in_flight=8), stall_timeout_s=5) as driver:
            async with asyncio.timeout(20):
                with pytest.raises(PipelineBroken, match="mailbox full"):
                    await driver.train(x, y, epochs=2, batch_size=8)
