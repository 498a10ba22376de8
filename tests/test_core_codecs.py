"""Gradient codecs through the Python interface in dniasync.train.compression."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from dniasync._core import (
    Int8Codec as Int8Core,
    NonFiniteGradientError,
    OneBitCodec as OneBitCore,
    ParamStore,
    ThresholdCodec as ThresholdCore,
    kernel_isa,
    kernel_isas,
    set_kernel_isa,
)
from dniasync.train.compression import (
    Codec,
    CodecName,
    CompressedTensor,
    Int8Codec,
    OneBitCodec,
    ThresholdCodec,
    make_codec,
)

SHAPE = (37, 29)
N = 37 * 29
NAMES: list[CodecName] = ["none", "threshold", "onebit", "int8"]


def grads(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(count)]


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_keeps_what_is_not_sent(name: CodecName) -> None:
    codec = make_codec(name, SHAPE, tau=0.8, block=64)
    sent = np.zeros(SHAPE, np.float64)
    given = np.zeros(SHAPE, np.float64)
    for g in grads(6):
        compressed = codec.compress(g)
        assert compressed.codec == name and compressed.shape == SHAPE
        decoded = codec.extract(compressed)
        assert decoded.shape == SHAPE and decoded.dtype == np.float32
        sent += decoded
        given += g
    if isinstance(codec, ThresholdCodec):
        # Everything given is either sent (as exactly +-tau) or still in the residual.
        np.testing.assert_allclose(sent + codec.residual(), given, atol=1e-4)
        assert set(np.unique(np.abs(decoded))) <= {0.0, np.float32(0.8)}
    elif isinstance(codec, OneBitCodec):
        np.testing.assert_allclose(sent + codec.error(), given, atol=1e-4)
        assert np.abs(codec.error()).max() < 4.0
    elif isinstance(codec, Int8Codec):
        scale = np.abs(g.reshape(-1)[:64]).max() / 127
        np.testing.assert_array_less(np.abs(decoded.reshape(-1)[:64] - g.reshape(-1)[:64]), scale / 2 + 1e-7)
    else:
        np.testing.assert_array_equal(sent, given)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_apply_equals_extract_then_step(name: CodecName, optimizer: str) -> None:
    sender = make_codec(name, SHAPE, tau=0.5, block=64)
    receiver = make_codec(name, SHAPE, tau=0.5, block=64)
    direct = ParamStore([("w", N)], optimizer)  # type: ignore[arg-type]
    dense = ParamStore([("w", N)], optimizer)  # type: ignore[arg-type]
    for g in grads(3, seed=2):
        compressed = sender.compress(g)
        receiver.apply(direct, "w", compressed, 0.1)
        dense.step("w", receiver.extract(compressed).reshape(-1), 0.1)
    np.testing.assert_allclose(direct.view("w"), dense.view("w"), rtol=1e-6, atol=1e-7)
    assert direct.version("w") == 3


@pytest.mark.parametrize("name", NAMES)
def test_add_to_adds_the_decoded_values_and_steps_no_optimizer(name: CodecName) -> None:
    codec = make_codec(name, SHAPE, tau=0.5, block=64)
    store = ParamStore([("w", N)], "adagrad")
    start = grads(1, seed=3)[0].reshape(-1)
    store.write("w", start)
    expected = start.copy()
    for g in grads(3, seed=4):
        compressed = codec.compress(g)
        codec.add_to(store, "w", compressed, alpha=-2.0)
        expected += np.float32(-2.0) * codec.extract(compressed).reshape(-1)
    np.testing.assert_allclose(store.view("w"), expected, rtol=1e-6, atol=1e-6)
    assert store.version("w") == 4 and store.steps("w") == 0  # three adds after the write; no optimizer step
    assert not store.view("w", state=1).any()  # Adagrad's accumulator untouched


def test_compression_ratios_match_payload_sizes() -> None:
    g = grads(1)[0]
    for codec in (make_codec("none", SHAPE), make_codec("onebit", SHAPE), make_codec("int8", SHAPE)):
        payload = codec.compress(g)
        assert codec.estimate_compression_ratio() == pytest.approx(N * 4 / payload.nbytes)
    assert make_codec("onebit", 1 << 20).estimate_compression_ratio() == pytest.approx(32 / 1.25)
    assert make_codec("int8", 1 << 20).estimate_compression_ratio() == pytest.approx(4 / (1 + 4 / 256))
    threshold = make_codec("threshold", SHAPE, tau=2.0, expected_density=0.05)
    assert threshold.estimate_compression_ratio() == pytest.approx(20.0)
    payload = threshold.compress(g)
    assert payload.nbytes == 4 * int((np.abs(g) >= 2.0).sum())
    assert threshold.estimate_compression_ratio() == pytest.approx(N * 4 / payload.nbytes)


def test_misaligned_payload_bytes_still_decode() -> None:
    codec = make_codec("threshold", SHAPE, tau=1.0)
    g = grads(1)[0]
    compressed = codec.compress(g)
    raw = np.frombuffer(b"\0" + compressed.payload.tobytes(), np.uint8)[1:]
    assert raw.ctypes.data % 4 != 0
    moved = CompressedTensor("threshold", SHAPE, raw)
    np.testing.assert_array_equal(codec.extract(moved), codec.extract(compressed))


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_is_rejected(name: CodecName) -> None:
    codec: Codec = make_codec(name, SHAPE, tau=1.0)
    with pytest.raises(TypeError, match="float32"):
        codec.compress(np.ones(SHAPE))
    with pytest.raises(ValueError, match="C-contiguous"):
        codec.compress(np.ones((37, 58), np.float32)[:, ::2])
    with pytest.raises(ValueError, match=f"expected {N} elements, got 10"):
        codec.compress(np.ones(10, np.float32))
    other = "int8" if name != "int8" else "onebit"
    wrong = make_codec(other, SHAPE).compress(grads(1)[0])
    with pytest.raises(ValueError, match="made by codec"):
        codec.extract(wrong)
    reshaped = CompressedTensor(name, (N,), codec.compress(grads(1)[0]).payload)
    with pytest.raises(ValueError, match="shape"):
        codec.extract(reshaped)


@pytest.mark.parametrize("name", ["threshold", "onebit", "int8"])
def test_nonfinite_gradient_leaves_codec_state_untouched(name: CodecName) -> None:
    codec = make_codec(name, SHAPE, tau=0.5)
    codec.compress(grads(1)[0])
    state = codec.residual() if isinstance(codec, ThresholdCodec) else (
        codec.error() if isinstance(codec, OneBitCodec) else None
    )
    bad = grads(1, seed=3)[0]
    bad[5, 5] = np.nan
    with pytest.raises(NonFiniteGradientError):
        codec.compress(bad)
    if isinstance(codec, ThresholdCodec):
        np.testing.assert_array_equal(codec.residual(), state)
    elif isinstance(codec, OneBitCodec):
        np.testing.assert_array_equal(codec.error(), state)


def test_corrupt_payloads_are_refused() -> None:
    threshold = make_codec("threshold", 100, tau=1.0)
    out_of_range = np.array([5, 100], np.uint32).view(np.uint8)
    with pytest.raises(ValueError, match="past the end"):
        threshold.extract(CompressedTensor("threshold", (100,), out_of_range))
    unsorted = np.array([7, 3], np.uint32).view(np.uint8)
    with pytest.raises(ValueError, match="ascending"):
        threshold.apply(ParamStore([("w", 100)]), "w", CompressedTensor("threshold", (100,), unsorted), 0.1)
    onebit = make_codec("onebit", 100)
    with pytest.raises(ValueError, match="payload bytes"):
        onebit.extract(CompressedTensor("onebit", (100,), np.zeros(3, np.uint8)))
    with pytest.raises(ValueError, match="unknown codec"):
        make_codec("zstd", 10)  # type: ignore[arg-type]


@pytest.fixture
def uncapped_kernels() -> Iterator[None]:
    yield
    set_kernel_isa(None)


def every_kernel_output(n: int) -> list[bytes]:
    """Bytes out of every optimizer step and codec, on data with rounding ties and zeros."""
    rng = np.random.default_rng(7)
    grad = rng.standard_normal(n).astype(np.float32)
    grad[::11] = np.round(grad[::11] * 4) / 2  # exact halves: ties for the 8-bit rounding
    grad[::13] = 0.0
    init = np.cos(np.arange(n, dtype=np.float32))
    out: list[bytes] = []
    for name in ("sgd", "momentum", "nesterov", "adagrad", "adam"):
        store = ParamStore([("w", n)], name, weight_decay=0.01, clip_norm=50.0)
        store.write("w", init)
        for _ in range(3):
            store.step("w", grad, 0.05)
        store.add("w", grad, -0.3)
        out += [store.view("w", state=k).tobytes() for k in range(store.state_slots + 1)]
    threshold, onebit, int8 = ThresholdCore(n, 0.9), OneBitCore(n, 24), Int8Core(n, 40)
    for _ in range(2):
        out += [threshold.encode(grad).tobytes(), onebit.encode(grad).tobytes()]
    out += [threshold.residual().tobytes(), onebit.error().tobytes(), int8.encode(grad).tobytes()]
    return out


def test_every_kernel_isa_gives_identical_bytes(uncapped_kernels: None) -> None:
    isas = kernel_isas()
    assert isas[0] == "base" and kernel_isa() == isas[-1]
    results = {}
    for isa in isas:
        set_kernel_isa(isa)
        assert kernel_isa() == isa
        results[isa] = every_kernel_output(4099)  # not a multiple of any register width
    for isa in isas[1:]:
        for k, (got, want) in enumerate(zip(results[isa], results["base"], strict=True)):
            assert got == want, f"{isa} differs from the portable kernels in output {k}"
    with pytest.raises(ValueError, match="not available"):
        set_kernel_isa("avx1024")  # type: ignore[arg-type]
