"""The wire codec: round trips, strict validation, and a fuzzed decoder."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dniasync
from dniasync import ActorRef, message
from dniasync.remote import DecodeError, Decoder, Limits, encode
from dniasync.remote._codec import FRAME_PREFIX, OP_ASK, OP_FAIL, OP_REPLY, OP_TELL, PART_PREFIX, VERSION


@message("test.codec.Point")
class Point:
    x: float
    y: float


@message("test.codec.Envelope")
class Envelope:
    seq: int
    label: str
    points: list[Point]
    weights: np.ndarray
    grad: torch.Tensor
    reply_to: ActorRef | None
    meta: dict[str, int]
    shape: tuple[int, ...]
    raw: bytes


class _Nowhere:
    alive = True

    async def ask(self, msg: Any, timeout: float | None) -> Any:
        raise AssertionError("not sent in codec tests")

    async def tell(self, msg: Any) -> None:
        raise AssertionError("not sent in codec tests")

    def tell_nowait(self, msg: Any) -> None:
        raise AssertionError("not sent in codec tests")

    def unsent_bytes(self) -> int:
        return 0


def resolve(address: str) -> ActorRef:
    return ActorRef(address, _Nowhere())


def wire(op: int, value: Any, corr: int = 1, limits: Limits = Limits()) -> list[bytes]:
    return list(encode(op, "target", corr, value).messages(op, 9, limits.part_bytes))


def decode_all(messages: list[bytes], decoder: Decoder | None = None) -> Any:
    decoder = decoder or Decoder(resolve)
    frames = [decoder.feed(m) for m in messages]
    assert all(f is None for f in frames[:-1])
    assert frames[-1] is not None
    return frames[-1]


def envelope(n: int = 12) -> Envelope:
    return Envelope(
        seq=7,
        label="grad",
        points=[Point(1.0, 2.5), Point(-3.0, 0.0)],
        weights=np.arange(n, dtype=np.float32).reshape(3, -1),
        grad=torch.linspace(0, 1, 5, dtype=torch.float64),
        reply_to=resolve("ps-0@127.0.0.1:7000"),
        meta={"step": 3},
        shape=(3, 4),
        raw=b"\x00\x01",
    )


def test_nested_message_with_tensors_and_refs_round_trips() -> None:
    sent = envelope()
    frame = decode_all(wire(OP_TELL, sent))
    got = frame.value
    assert frame.error is None and frame.target == "target"
    assert isinstance(got, Envelope)
    assert got.points == sent.points and got.meta == sent.meta and got.shape == (3, 4) and got.raw == b"\x00\x01"
    assert isinstance(got.weights, np.ndarray) and got.weights.dtype == np.float32
    np.testing.assert_array_equal(got.weights, sent.weights)
    assert isinstance(got.grad, torch.Tensor) and got.grad.dtype == torch.float64
    assert torch.equal(got.grad, sent.grad)
    assert got.reply_to == sent.reply_to
    got.weights[0, 0] = -1.0  # received arrays are writable


def test_big_tensor_is_streamed_in_parts_and_arrives_whole() -> None:
    big = envelope(3 * 400_000)  # 4.8 MB of float32
    messages = wire(OP_ASK, big)
    assert len(messages) > 8
    assert max(len(m) for m in messages) <= Limits().max_ws_message
    got = decode_all(messages).value
    np.testing.assert_array_equal(got.weights, big.weights)


def test_parts_of_two_streams_interleave() -> None:
    part = Limits().part_bytes
    a = list(encode(OP_TELL, "t", 0, envelope(3 * 300_000)).messages(OP_TELL, 9, part))
    b = list(encode(OP_TELL, "t", 0, envelope(3 * 200_000)).messages(OP_TELL, 10, part))
    decoder = Decoder(resolve)
    out = []
    for i in range(max(len(a), len(b))):
        for stream in (a, b):
            if i < len(stream):
                frame = decoder.feed(stream[i])
                if frame is not None:
                    out.append(frame.value.weights.size)
    assert out == [600_000, 900_000]


def test_bfloat16_and_scalar_and_empty_tensors() -> None:
    value = [torch.ones(3, dtype=torch.bfloat16), np.float32(2.5), np.zeros((0, 4)), torch.tensor(3)]
    got = decode_all(wire(OP_REPLY, value)).value
    assert got[0].dtype == torch.bfloat16 and got[0].tolist() == [1.0, 1.0, 1.0]
    assert got[1] == 2.5 and got[2].shape == (0, 4) and got[3].item() == 3


def test_unregistered_message_or_gpu_tensor_is_refused_at_the_sender() -> None:
    class Plain:
        pass

    with pytest.raises(TypeError, match="not a registered message"):
        encode(OP_TELL, "t", 0, Plain())
    with pytest.raises(TypeError, match="cannot send"):
        encode(OP_REPLY, "t", 0, {"x": Plain()})


def raw_frame(op: int, header: list[Any], payload: bytes = b"", flags: int = 0, announce: int | None = None) -> bytes:
    packed = msgpack.packb(header)
    length = len(payload) if announce is None else announce
    return FRAME_PREFIX.pack(VERSION, op, flags, len(packed), 4, length) + packed + payload


def tensor_ext(desc: list[Any]) -> msgpack.ExtType:
    return msgpack.ExtType(2, msgpack.packb(desc))


def test_unknown_tag_is_a_clear_non_fatal_error() -> None:
    frame = Decoder(resolve).feed(raw_frame(OP_ASK, ["no.such.Tag", "target", None, 3, [1]]))
    assert frame is not None and frame.value is None and frame.corr == 3
    assert frame.error is not None and not frame.error.fatal and "unknown message tag" in str(frame.error)


def test_wrong_field_type_is_rejected_with_the_field_name() -> None:
    frame = Decoder(resolve).feed(raw_frame(OP_TELL, ["test.codec.Point", "target", None, 3, ["one", 2.0]]))
    assert frame is not None and frame.error is not None
    assert "test.codec.Point.x" in str(frame.error) and "expected float" in str(frame.error)


@pytest.mark.parametrize(
    ("desc", "payload", "match"),
    [
        (["float32", [4], 15, 0, 0], bytes(64), "nbytes"),
        (["object", [1], 8, 0, 0], bytes(64), "dtype"),
        (["float32", [-1], -4, 0, 0], b"", "dimension"),
        (["bfloat16", [2], 4, 0, 0], bytes(64), "only valid for torch"),
        (["float32", [4], 16, 0, 64], bytes(128), "offset"),
        (["float32", [100], 400, 0, 0], bytes(64), "needs payload bytes"),
        (["float32", [4], 16, 0, 0], bytes(128), "cover"),
        (["float32", [4], 16, 9, 0], bytes(64), "kind"),
    ],
)
def test_bad_tensor_descriptors_lose_only_their_message(desc: list[Any], payload: bytes, match: str) -> None:
    frame = Decoder(resolve).feed(raw_frame(OP_ASK, ["test.codec.Point", "", None, 5, [tensor_ext(desc), 1.0]], payload))
    assert frame is not None and frame.corr == 5 and frame.error is not None
    assert match in str(frame.error) and not frame.error.fatal


@pytest.mark.parametrize(
    ("payload", "announce", "match"),
    [(bytes(10), 64, "truncated"), (bytes(200), 64, "truncated"), (b"", 1 << 62, "exceeds the limit")],
)
def test_frames_announcing_other_sizes_than_they_carry_are_fatal(payload: bytes, announce: int, match: str) -> None:
    data = raw_frame(OP_REPLY, [None, "", None, 1, tensor_ext(["uint8", [64], 64, 0, 0])], payload, announce=announce)
    with pytest.raises(DecodeError, match=match) as info:
        Decoder(resolve).feed(data)
    assert info.value.fatal


def test_stream_announcing_more_than_the_limit_is_refused_before_allocating() -> None:
    limits = Limits(max_message_bytes=1 << 20)
    data = raw_frame(OP_REPLY, [None, "", None, 1, None], flags=1, announce=1 << 40)
    with pytest.raises(DecodeError, match="limit"):
        Decoder(resolve, limits).feed(data)


def test_streams_together_may_not_reserve_more_than_the_budget() -> None:
    decoder = Decoder(resolve, Limits(max_message_bytes=1 << 20, max_pending_bytes=3 << 19))
    for stream in (1, 2, 3):
        frame = FRAME_PREFIX.pack(VERSION, OP_REPLY, 1, 1, stream, 1 << 19) + msgpack.packb(None)
        assert decoder.feed(frame) is None
    with pytest.raises(DecodeError, match="more than"):
        decoder.feed(FRAME_PREFIX.pack(VERSION, OP_REPLY, 1, 1, 4, 1) + msgpack.packb(None))


def test_parts_beyond_the_announced_size_or_of_unknown_streams_are_fatal() -> None:
    decoder = Decoder(resolve)
    assert decoder.feed(raw_frame(OP_REPLY, [None, "", None, 1, None], flags=1, announce=1024)) is None
    assert decoder.pending_bytes == 1024
    with pytest.raises(DecodeError, match="more bytes"):
        decoder.feed(PART_PREFIX.pack(VERSION, 6, 0, 4) + bytes(2000))
    with pytest.raises(DecodeError, match="unknown stream"):
        decoder.feed(PART_PREFIX.pack(VERSION, 6, 0, 77) + bytes(10))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "shorter"),
        (bytes([9, 1]) + bytes(30), "version"),
        (bytes([VERSION, 42]) + bytes(30), "op"),
        (FRAME_PREFIX.pack(VERSION, OP_TELL, 0, 1 << 31, 0, 0), "exceeds"),
        (FRAME_PREFIX.pack(VERSION, OP_TELL, 0, 500, 0, 0) + b"\x93", "truncated"),
        (FRAME_PREFIX.pack(VERSION, OP_TELL, 0, 1, 0, 0) + b"\xc1", "malformed header"),
        (raw_frame(OP_TELL, ["x", "t", None, -1, []]), "correlation"),
        (raw_frame(OP_TELL, ["x", 5, None, 1, []]), "target"),
    ],
)
def test_malformed_frames_are_fatal_decode_errors(data: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        Decoder(resolve).feed(data)


def test_deeply_nested_messages_are_refused() -> None:
    ext = msgpack.ExtType(3, msgpack.packb(["test.codec.Point", [1.0, 2.0]]))
    for _ in range(40):
        ext = msgpack.ExtType(3, msgpack.packb(["test.codec.Point", [ext, 1.0]]))
    frame = Decoder(resolve).feed(raw_frame(OP_REPLY, [None, "", None, 1, ext]))
    assert frame is not None and frame.error is not None and "nested" in str(frame.error)


def test_remote_errors_travel_as_type_name_and_text() -> None:
    got = decode_all(wire(OP_FAIL, ["ValueError", "bad lr"])).value
    assert got == ["ValueError", "bad lr"]


def test_no_pickle_marshal_or_eval_in_the_network_path() -> None:
    root = pathlib.Path(dniasync.__file__).parent
    banned = re.compile(r"^\s*(import|from)\s+(c?pickle|marshal|dill|cloudpickle)\b|(?<![\w.])(eval|exec)\(", re.M)
    for package in ("remote", "node", "actors"):
        for path in (root / package).glob("*.py"):
            found = banned.search(path.read_text())
            assert found is None, f"{found.group(0)!r} in {path}"


# -- fuzzing ------------------------------------------------------------------------------

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=20) | st.just([]) | st.just({}),
    lambda children: st.lists(children, min_size=1, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, min_size=1, max_size=4),
    max_leaves=20,
)
arrays = st.builds(
    lambda shape, dtype: (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape),
    st.lists(st.integers(0, 5), max_size=3),
    st.sampled_from(["float32", "float64", "int64", "uint8", "bool"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=plain, array=arrays, part=st.sampled_from([64, 4096, 1 << 19]))
def test_fuzz_round_trip_of_plain_values_and_arrays(value: Any, array: np.ndarray, part: int) -> None:
    limits = Limits(part_bytes=part)
    messages = list(encode(OP_REPLY, "x", 5, [value, array]).messages(OP_REPLY, 3, part))
    got = decode_all(messages, Decoder(resolve, limits)).value
    assert got[0] == value
    np.testing.assert_array_equal(got[1], array)
    assert got[1].dtype == array.dtype


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=300))
def test_fuzz_random_bytes_only_ever_raise_decode_error(data: bytes) -> None:
    try:
        Decoder(resolve).feed(data)
    except DecodeError:
        pass


@settings(max_examples=400, deadline=None)
@given(
    cut=st.integers(0, 400),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
    version_prefix=st.booleans(),
)
def test_fuzz_mutated_valid_frames_only_ever_raise_decode_error(
    cut: int, flips: list[tuple[int, int]], version_prefix: bool
) -> None:
    data = bytearray(wire(OP_TELL, envelope())[0])
    for index, byte in flips:
        data[index % len(data)] = byte
    if version_prefix:
        data[0] = VERSION
    data = data[: len(data) - cut % len(data)]
    try:
        frame = Decoder(resolve).feed(bytes(data))
    except DecodeError:
        return
    assert frame is None or frame.error is None or isinstance(frame.error, DecodeError)
