"""Convolutional stages: a CNN cut anywhere, 4-D activations on the wire, conv SG models, bad cuts named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from dniasync import ActorRef, ActorSystem
from dniasync.remote import Decoder, Limits, encode
from dniasync.remote._codec import OP_TELL
from dniasync.train.models import cnn
from dniasync.train.pipeline import (
    GroupConfigError,
    PipelineDriver,
    Schedule,
    StageSettings,
    batch_order,
    build_stages,
    run_pipeline,
    spawn_stages,
    train_backprop,
)
from dniasync.train.pipeline.protocol import Forward, Gradient
from dniasync.train.pipeline.synthetic import SyntheticGradient

torch.set_num_threads(1)

IMAGE = (1, 8, 8)  # sklearn's digits


def small_cnn(seed: int = 0, norm: str = "batch") -> nn.Sequential:
    torch.manual_seed(seed)
    return cnn(image=IMAGE, channels=(4, 8), hidden=32, norm=norm)


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    return torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target, dtype=torch.int64)


class _Nowhere:
    alive = True

    async def ask(self, msg: Any, timeout: float | None) -> Any:
        raise AssertionError("not sent")

    async def tell(self, msg: Any) -> None:
        raise AssertionError("not sent")

    def tell_nowait(self, msg: Any) -> None:
        raise AssertionError("not sent")

    def unsent_bytes(self) -> int:
        return 0


def _wire(msg: Any) -> Any:
    """``msg`` through the remote codec: encoded into websocket messages (small parts: streamed), decoded."""
    decoder = Decoder(lambda address: ActorRef(address, _Nowhere()))
    frames = [decoder.feed(m) for m in encode(OP_TELL, "stage", 1, msg).messages(OP_TELL, 3, Limits().part_bytes)]
    assert frames[-1] is not None and frames[-1].error is None
    return frames[-1].value


def test_cnn_factory_layers() -> None:
    model = cnn()
    assert len(model) == 13
    assert isinstance(model[0], nn.Unflatten) and isinstance(model[9], nn.Flatten)
    assert model(torch.zeros(3, 784)).shape == (3, 10)
    with pytest.raises(ValueError, match="unknown norm"):
        cnn(norm="layer")
    with pytest.raises(ValueError, match="do not fit"):
        cnn(image=(1, 4, 4), channels=(2, 2, 2, 2))


@pytest.mark.parametrize("cut", range(1, 13))
def test_a_cnn_cut_at_every_boundary_round_trips_bit_exactly(cut: int) -> None:
    model = cnn()
    specs = build_stages(model, [list(range(cut)), list(range(cut, 13))], StageSettings(rule="sync"), 784)
    first, second = specs
    assert first.shape.out_dims == second.shape.in_dims and first.shape.out_features == second.shape.in_features
    torch.manual_seed(cut)
    x = torch.rand(5, 784)
    h_in = x.requires_grad_(False)
    h_out = first.layers(h_in)
    assert tuple(h_out.shape[1:]) == first.shape.out_dims
    labels = torch.randint(0, 10, (5,))
    sent = _wire(Forward(7, 7, 1, 1.0, h_out.detach(), labels))
    assert isinstance(sent, Forward)
    assert sent.activations.shape == h_out.shape and sent.activations.dtype == h_out.dtype
    assert torch.equal(sent.activations, h_out.detach()) and torch.equal(sent.labels, labels)
    # the gradient of the downstream stage's loss at its input goes back the same way
    x2 = sent.activations.clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(second.layers(x2), labels)
    loss.backward()  # type: ignore[no-untyped-call]
    assert x2.grad is not None
    back = _wire(Gradient(7, x2.grad))
    assert isinstance(back, Gradient) and back.gradient.shape == h_out.shape
    assert torch.equal(back.gradient, x2.grad)


def test_bad_cuts_and_layers_fail_at_start_naming_the_layer() -> None:
    settings = StageSettings(rule="sync")
    no_flatten = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Linear(36, 10))
    with pytest.raises(GroupConfigError, match=r"layer 3 \(Linear\) cannot take activations of shape \(4, 6, 6\)"):
        build_stages(no_flatten, [[0, 1], [2, 3]], settings, 64)
    wrong_channels = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 10))
    with pytest.raises(GroupConfigError, match=r"layer 1 \(Conv2d\) cannot take"):
        build_stages(wrong_channels, [[0, 1], [2, 3]], settings, 64)
    no_logits = nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3))
    with pytest.raises(GroupConfigError, match=r"layer 1 \(Conv2d\) is the last layer: it must give \(batch, classes\)"):
        build_stages(no_logits, [[0], [1]], settings, 64)
    lstm = nn.Sequential(nn.Unflatten(1, (8, 8)), nn.LSTM(8, 8), nn.Flatten(), nn.Linear(64, 10))
    with pytest.raises(GroupConfigError, match=r"layer 1 \(LSTM\) is not supported in a pipeline: it returns a tuple"):
        build_stages(lstm, [[0, 1], [2, 3]], settings, 64)
    dropout = nn.Sequential(nn.Linear(64, 32), nn.Dropout(0.5), nn.Linear(32, 10))
    build_stages(dropout, [[0, 1], [2]], StageSettings(rule="stash"), 64)  # stash runs the forward's own graph
    for rule in ("async", "spectrain"):
        with pytest.raises(GroupConfigError, match=rf"layer 1 \(Dropout\) is not supported by the rule '{rule}'"):
            build_stages(dropout, [[0, 1], [2]], StageSettings(rule=rule, optimizer="adam"), 64)
    with pytest.raises(GroupConfigError, match="in no group"):
        build_stages(small_cnn(), [[0, 1], [3]], settings, 64)


@pytest.mark.parametrize("num_classes", [0, 10])
def test_conv_synthetic_gradient_is_zero_before_training_and_learns(num_classes: int) -> None:
    torch.manual_seed(0)
    sg = SyntheticGradient(4 * 6 * 6, num_classes=num_classes, hidden_layers=1, shape=(4, 6, 6), lr=1e-2)
    assert any(isinstance(m, nn.Conv2d) for m in sg.modules())
    h = torch.randn(16, 4, 6, 6)
    labels = torch.randint(0, 10, (16,))
    out = sg(h, labels)
    assert out.shape == h.shape and torch.count_nonzero(out) == 0
    target = -0.1 * h + (labels.float()[:, None, None, None] / 10 if num_classes else 0.0)
    first = sg.fit(h, labels, target)
    for _ in range(200):
        last = sg.fit(h, labels, target)
    assert last < 0.2 * first


@pytest.mark.parametrize(("rule", "optimizer", "momentum"),
                         [("sync", "adam", 0.0), ("async", "sgd", 0.9), ("stash", "sgd", 0.9),
                          ("spectrain", "sgd", 0.9), ("spectrain", "adam", 0.0), ("spectrain_stash", "sgd", 0.9)])
async def test_cnn_pipeline_with_one_batch_in_flight_reproduces_backprop(
    digits: tuple[torch.Tensor, torch.Tensor], rule: str, optimizer: str, momentum: float
) -> None:
    """Conv, batch norm and pooling layers on both sides of each cut: still backprop exactly."""
    x, y = digits[0][:160], digits[1][:160]
    groups = [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    lr = 0.05 if optimizer == "sgd" else 1e-3
    reference = small_cnn(seed=4)
    train_backprop(reference, x, y, epochs=1, batch_size=32, seed=1, lr=lr, optimizer=optimizer, momentum=momentum)
    settings = StageSettings(rule=rule, optimizer=optimizer, momentum=momentum, lr=lr)
    batches = [idx for _, idx in batch_order(160, 32, epochs=1, seed=1)]
    async with ActorSystem() as system:
        refs = await spawn_stages(system, small_cnn(seed=4), groups, settings, 64)
        async with PipelineDriver(system, refs, Schedule(max_in_flight=1)) as driver:
            await driver.train(x, y, batches)
            states = await driver.states()
    got = {f"{g[int(n.split('.')[0])]}.{n.split('.', 1)[1]}": t for g, st in zip(groups, states) for n, t in st.items()}
    want = reference.state_dict()
    assert got.keys() == want.keys()  # running statistics too: a recomputed forward leaves them alone
    for key in want:
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", ["cdni", "spectrain", "sync"])
async def test_cnn_trains_as_a_pipeline(digits: tuple[torch.Tensor, torch.Tensor], rule: str) -> None:
    x, y = digits
    settings = StageSettings(rule=rule, optimizer="adam", lr=3e-3, sg_hidden_layers=1, sg_lr=1e-3)
    result = await run_pipeline(small_cnn(seed=0), [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]], x[:1400],
                                y[:1400], settings=settings, epochs=3, batch_size=32, max_in_flight=3,
                                micro_batches=2, eval_x=x[1400:], eval_y=y[1400:])
    # backprop reaches ~0.9 here; on a loaded machine the asynchronous runs vary (0.76-0.9 seen for cDNI and
    # SpecTrain after 3 epochs); chance is 0.1
    assert result.history[-1].accuracy > 0.65


def test_a_cnn_config_with_a_bad_layer_fails_when_parsed_naming_the_layer() -> None:
    import tomllib
    from pathlib import Path

    from dniasync.cluster.config import ConfigError, parse_config

    raw = tomllib.loads((Path(__file__).resolve().parent.parent / "examples/cnn_mnist_cdni.toml").read_text())
    assert parse_config(raw).settings.method == "cdni"
    raw["model"]["kwargs"]["image"] = [1, 20, 20]
    with pytest.raises(ConfigError, match=r"'pipeline.groups': layer 0 \(Unflatten\) cannot take activations of "
                                          r"shape \(784,\)"):
        parse_config(raw)
    raw["model"]["kwargs"]["image"] = [1, 28, 28]
    raw["pipeline"]["groups"] = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]
    with pytest.raises(ConfigError, match=r"layers \[12\] are in no group"):
        parse_config(raw)
