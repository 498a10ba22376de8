"""Sparse pushes of embedding tables (#29): only the touched rows travel, and the PS shards end where dense pushes
leave them, bit for bit. The whole job (the text example, dense against sparse) is in ``tests/test_text.py``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dniasync import ActorSystem
from dniasync.actors import ActorRef
from dniasync.cluster.config import ConfigError, parse_config
from dniasync.train.flat import flatten_parameters, split_ranges
from dniasync.train.messages import Params, Pull, Push, ShardStats
from dniasync.train.ps import PSShard
from dniasync.train.sparse import EmbeddingTable, embedding_tables, spans_of, touched
from dniasync.train.specs import OptimizerSpec, ShardSpec
from dniasync.train.sync.ps import ShardLink

VOCAB, DIM, CLASSES = 1000, 8, 3


def text_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.EmbeddingBag(VOCAB, DIM, mode="mean", padding_idx=0), nn.Linear(DIM, CLASSES))


def gradients(model: nn.Module, steps: int) -> list[np.ndarray]:
    """The flat gradients of ``steps`` batches of 16 rows of 12 token ids out of the first 200 (a few rows each)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        x = torch.from_numpy(rng.integers(0, 200, (16, 12)))
        y = torch.from_numpy(rng.integers(0, CLASSES, 16))
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy())
    return out


def test_the_tables_and_the_rows_a_gradient_touched() -> None:
    model = text_model()
    tables = embedding_tables(model)
    assert tables == [EmbeddingTable(0, VOCAB, DIM)]
    grad = gradients(model, 1)[0]
    rows = np.flatnonzero(grad[:VOCAB * DIM].reshape(VOCAB, DIM).any(axis=1))
    assert 0 < rows.size < 200 and 0 not in rows  # the padding row gets no gradient
    mask = touched(grad, tables, "auto")
    assert mask is not None and mask.size == grad.size and mask[VOCAB * DIM:].all()  # the Linear layer goes whole
    assert np.array_equal(np.flatnonzero(mask[:VOCAB * DIM].reshape(VOCAB, DIM).all(axis=1)), rows)
    assert not grad[~mask].any()  # what stays home is zero
    assert touched(grad, tables, "never") is None
    dense = np.ones_like(grad)
    assert touched(dense, tables, "auto") is None  # every row touched: dense is smaller
    assert touched(dense, tables, "always") is not None
    spans = spans_of(np.array([1, 1, 0, 0, 1, 0, 1, 1, 1], dtype=np.bool_))
    assert spans.dtype == np.uint32 and spans.tolist() == [[0, 2], [4, 1], [6, 3]]
    assert spans_of(np.zeros(3, dtype=np.bool_)).shape == (0, 2)


async def pull_all(shards: list[ActorRef]) -> np.ndarray:
    parts = []
    for shard in shards:
        reply = await shard.ask(Pull(), timeout=10.0)
        assert isinstance(reply, Params)
        parts.append(reply.values)
    return np.concatenate(parts)


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd", "adam"])
async def test_a_sparse_and_a_dense_push_of_the_same_gradients_leave_the_same_weights(optimizer: str) -> None:
    """Three shards over the table and the Linear layer (the cuts fall inside rows), reached over a websocket: the
    weights after 5 pushes are equal bit for bit; the sparse link counts what it sent (values and spans)."""
    from dniasync.remote import WebSocketTransport

    model = text_model()
    initial = flatten_parameters(model)
    grads = gradients(model, 5)
    ranges = split_ranges(initial.size, 3)
    opt = OptimizerSpec(optimizer, 0.1)
    async with ActorSystem() as ps_system, ActorSystem() as worker_system:
        async with WebSocketTransport(ps_system) as ps_node, WebSocketTransport(worker_system):
            links: dict[str, ShardLink] = {}
            refs: dict[str, list[ActorRef]] = {}
            for mode in ("never", "auto"):
                refs[mode] = []
                for k, (offset, length) in enumerate(ranges):
                    spec = ShardSpec(k, offset, initial[offset:offset + length].copy(), opt)
                    await ps_system.spawn(PSShard, spec, name=f"{mode}-{k}")
                    refs[mode].append(worker_system.ref(f"{mode}-{k}@{ps_node.address}"))
                links[mode] = ShardLink(initial.copy(), ranges, refs[mode], replica="r0", incarnation=1,
                                        tables=embedding_tables(model), sparse=mode)
            for grad in grads:
                for link in links.values():
                    await link.push(grad, samples=16)
            dense, sparse = await pull_all(refs["never"]), await pull_all(refs["auto"])
            stats = [await ref.ask(ShardStats(), timeout=10.0) for ref in refs["auto"]]
    assert not np.array_equal(dense, initial)
    np.testing.assert_array_equal(sparse, dense)
    assert all(s["applied"] == 5 and not any(s["rejected"].values()) for s in stats)
    sent = 0
    for grad in grads:
        mask = touched(grad, embedding_tables(model), "auto")
        assert mask is not None
        for offset, length in ranges:
            sent += 4 * int(mask[offset:offset + length].sum()) + 8 * len(spans_of(mask[offset:offset + length]))
    assert links["auto"].bytes_pushed == sent == sum(s["bytes_in"] for s in stats)
    assert links["never"].bytes_pushed == 5 * 4 * initial.size == links["auto"].dense_bytes_pushed
    assert links["auto"].sparse_pushes == 15 and links["never"].sparse_pushes == 0
    assert links["never"].bytes_pushed > 5 * links["auto"].bytes_pushed  # about 120 of 1,000 rows a push


async def test_a_shard_refuses_spans_that_do_not_fit_and_keeps_serving() -> None:
    n = 16
    values = np.ones(4, dtype=np.float32).view(np.uint8)
    bad: list[Any] = [
        np.array([[14, 4]], dtype=np.uint32),  # past the end
        np.array([[4, 2], [5, 2]], dtype=np.uint32),  # overlapping
        np.array([[0, 2]], dtype=np.uint32),  # fewer elements than values
        np.array([0, 4], dtype=np.uint32),  # not [k, 2]
        np.array([[0, 4]], dtype=np.int64),  # not uint32
    ]
    async with ActorSystem() as system:
        shard = await system.spawn(PSShard, ShardSpec(0, 0, np.zeros(n, np.float32), OptimizerSpec("sgd", 1.0)),
                                   name="ps-0")
        for seq, spans in enumerate(bad, start=1):
            await shard.tell(Push("r0", 1, seq, 0, "none", values, 4, spans))
        await shard.tell(Push("r0", 1, 9, 0, "int8", values, 4, np.array([[0, 4]], dtype=np.uint32)))
        await shard.tell(Push("r0", 1, 10, 0, "none", values, 4, np.array([[2, 1], [8, 3]], dtype=np.uint32)))
        reply = await shard.ask(Pull())
        stats = await shard.ask(ShardStats())
    assert stats["rejected"]["bad_payload"] == 6 and stats["applied"] == 1
    expected = np.zeros(n, np.float32)
    expected[[2, 8, 9, 10]] = -1.0
    np.testing.assert_array_equal(reply.values, expected)


def test_sparse_true_takes_no_codec() -> None:
    raw: dict[str, Any] = {
        "job": {"name": "t", "mode": "downpour"},
        "model": {"factory": "dniasync.train.models:fasttext"},
        "data": {"dataset": "mnist5k", "n_train": 100, "n_test": 100},
        "downpour": {"codec": "int8", "sparse": True},
    }
    with pytest.raises(ConfigError, match="downpour.sparse"):
        parse_config(raw, resolve=False)
    for sparse in ("auto", False):
        assert parse_config(raw | {"downpour": {"codec": "int8", "sparse": sparse}}, resolve=False).settings.sparse \
            == sparse
    with pytest.raises(ConfigError, match="downpour.sparse"):
        parse_config(raw | {"downpour": {"sparse": "yes"}}, resolve=False)


def backward(sync: Any, grad: np.ndarray) -> None:
    """What a backward leaves: ``grad`` (the flat vector) in each parameter's ``.grad``."""
    for param, offset, k in sync.flat.slices():
        param.grad = torch.from_numpy(grad[offset:offset + k].copy()).view_as(param)


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_a_hogwild_step_writes_only_the_touched_rows_and_ends_where_the_dense_step_does(optimizer: str) -> None:
    """Two workers' syncs over one shared store (one sparse, one dense, taking turns) leave the weights a dense-only
    pair of stores gets; with Adagrad the sparse step never writes a row it did not touch (another worker's update
    of that row, made meanwhile, stays), while Adam moves every row and so steps densely."""
    import os

    from dniasync.train.sync.shm import HOGWILD_SEGMENT, SharedStoreSync

    spec = OptimizerSpec(optimizer, 0.1)
    grads = gradients(text_model(), 4)
    stores = {}
    for mode in ("auto", "never"):
        name = f"sparse-test-{mode}-{optimizer}-{os.getpid()}"
        model = text_model()
        owner = spec.store([(HOGWILD_SEGMENT, flatten_parameters(model).size)], shm_name=name)
        owner.write(HOGWILD_SEGMENT, flatten_parameters(model))
        sync = SharedStoreSync(model, name, spec, sparse=mode)
        for grad in grads:
            backward(sync, grad)
            sync.step()
        stores[mode] = (owner, sync)
    (sparse_store, sparse), (dense_store, dense) = stores["auto"], stores["never"]
    np.testing.assert_allclose(sparse_store.view(HOGWILD_SEGMENT), dense_store.view(HOGWILD_SEGMENT), rtol=1e-6,
                               atol=1e-7)
    assert sparse.sparse_steps == 4 and dense.sparse_steps == 0
    if optimizer == "adagrad":  # a row no gradient touched: another worker's write to it is not overwritten
        untouched = np.flatnonzero(~np.any([g[:VOCAB * DIM].reshape(VOCAB, DIM).any(axis=1) for g in grads], axis=0))
        assert untouched.size > 0
        row = int(untouched[-1])
        sparse_store.view(HOGWILD_SEGMENT)[row * DIM:(row + 1) * DIM] = 7.0
        backward(sparse, grads[0])
        sparse.step()
        assert (sparse_store.view(HOGWILD_SEGMENT)[row * DIM:(row + 1) * DIM] == 7.0).all()
    for owner, _ in stores.values():
        owner.close()
