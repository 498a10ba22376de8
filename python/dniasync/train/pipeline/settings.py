"""How the stages of a pipeline train (:class:`StageSettings`) and where one sits (:class:`StageShape`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["StageSettings", "StageShape"]


@dataclass(frozen=True)
class StageSettings:
    """How every stage of a pipeline trains.

    ``rule`` names the update rule (see :func:`~dniasync.train.pipeline.rules.get_rule`):
    ``"dni"`` (update at once from a synthetic gradient), ``"cdni"`` (the same,
    the SG model conditioned on the labels), ``"sync"`` (the synchronous
    pipeline: wait for the true gradient, GPipe-style micro-batches), or one of
    the asynchronous pipelines with real gradients (1F1B, many batches in
    flight, each stage updates when a batch's gradient returns): ``"async"``
    (no correction), ``"stash"`` (PipeDream weight stashing) and
    ``"spectrain"`` (SpecTrain weight prediction) and ``"spectrain_stash"`` (its
    forward, back-propagated through its own graph on the predicted weights).
    ``cache_size`` bounds the batches a stage keeps while their gradient is on
    its way back (DNI: outputs for SG training; sync: graphs; async, stash and
    spectrain: inputs, and stash its weight versions; spectrain_stash: graphs
    and predicted weights).
    ``optimizer``: the stage's own torch optimizer (``"adam"``, ``"sgd"`` or
    ``"adagrad"``); the SG and input models step Adam for an Adagrad stage
    (their ``sg_lr`` and ``input_lr`` are Adam's), and the stage's own otherwise.
    ``momentum``: SGD's momentum (SpecTrain predicts with the momentum buffer).
    ``optimizer_on_ps``: the stages' replicas share their weights through PS
    shards, which apply the job's optimizer (any: ``optimizer`` and
    ``momentum`` are not the stages'); SpecTrain then predicts from the
    weights' observed velocity.
    ``max_in_flight``: the batches the driver keeps in flight, SpecTrain's prior
    for a stage's version gap until it has measured it.

    The ``sg_*``, ``synthetic_inputs`` and ``input_lr`` options belong to the
    synthetic-gradient rules. ``synthetic_inputs``: stages after the first also
    learn to predict their input from the raw data and train on it before the
    real input arrives. ``sg_fit_rows``: fit the SG model on the first this
    many rows of each returning batch (0: all). Batches are shuffled, so the
    rows are a random sample; fitting on half a batch of 128 halves the SG
    model's training cost for a small loss in accuracy (see
    ``benchmarks/bench_dni.py``).
    """

    rule: str = "dni"
    lr: float = 1e-3
    optimizer: Literal["adam", "sgd", "adagrad"] = "adam"
    momentum: float = 0.0
    optimizer_on_ps: bool = False
    max_in_flight: int = 1
    num_classes: int = 10
    cache_size: int = 64
    trace: bool = False
    send_timeout_s: float = 30.0
    """A send that waits this long on a full mailbox is dropped and reported."""
    sg_hidden_layers: int = 1
    sg_hidden_width: int = 0
    """0: as wide as the activations."""
    sg_lr: float = 1e-4
    sg_fit_rows: int = 0
    synthetic_inputs: bool = False
    input_lr: float = 1e-3

    @property
    def model_optimizer(self) -> str:
        """The SG and input models' optimizer: Adam beside an Adagrad stage, else the stage's own."""
        return "adam" if self.optimizer == "adagrad" else self.optimizer

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd", "adagrad"):
            raise ValueError(f"optimizer must be 'adam', 'sgd' or 'adagrad', got {self.optimizer!r}")
        if self.sg_hidden_layers < 0 or self.sg_hidden_width < 0 or self.sg_fit_rows < 0:
            raise ValueError("sg_hidden_layers, sg_hidden_width and sg_fit_rows must be >= 0")
        if self.send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s must be > 0, got {self.send_timeout_s}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {self.cache_size}")


@dataclass(frozen=True)
class StageShape:
    """Where a stage sits: its input and output sizes, the raw input's, whether it is last, its seed.

    ``in_features`` and ``out_features`` count the values of one sample's
    activations; ``in_shape`` and ``out_shape`` give their shape without the
    batch dimension (``()``: flat, ``(features,)``). ``index`` of ``stages``:
    the stage's place in its pipeline.
    """

    in_features: int
    out_features: int
    raw_features: int
    last: bool
    seed: int = 0
    in_shape: tuple[int, ...] = ()
    out_shape: tuple[int, ...] = ()
    index: int = 0
    stages: int = 1

    @property
    def in_dims(self) -> tuple[int, ...]:
        """One sample's input shape (``(in_features,)`` when flat)."""
        return self.in_shape or (self.in_features,)

    @property
    def out_dims(self) -> tuple[int, ...]:
        """One sample's output shape (``(out_features,)`` when flat)."""
        return self.out_shape or (self.out_features,)
