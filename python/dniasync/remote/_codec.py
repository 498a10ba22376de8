"""The wire codec: messages <-> websocket binary frames. No object serialization, no eval.

A frame is one websocket binary message::

    prefix   <BBHIIQ  version, op, flags, header length, stream id, payload length
    header   msgpack [tag, target, sender, corr, body]
    payload  the tensors' raw bytes, each at a 64-byte aligned offset

``body`` is the message's field values (the reply value, for replies);
msgpack extension types in it carry what plain msgpack cannot: actor refs
(as addresses), tensors (``[dtype, shape, nbytes, kind, offset]`` into the
payload) and nested registered messages (``[tag, [fields...]]``). Decoding
validates every field against the message class's annotations.

A frame whose payload is larger than one part is *streamed*: the frame
carries the header only and the payload follows in ``PART`` messages
(``<BBHI`` version, op, flags, stream id, then bytes), so small frames to
the same node go between the parts of a big one. Since every length is in
the prefix, a message that fails validation costs only itself; bytes that
cannot be framed (bad prefix, truncated, oversized) close the connection.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
from collections.abc import Callable, Iterator
from typing import Any, Final

import msgpack
import numpy as np

from ..actors import ActorRef, message_spec
from ._errors import DecodeError
from ._shm import PeerRing
from ._validate import message_schema as _schema

__all__ = [
    "OP_ASK",
    "OP_FAIL",
    "OP_PART",
    "OP_PING",
    "OP_REPLY",
    "OP_SHM",
    "OP_TELL",
    "VERSION",
    "Decoder",
    "Encoded",
    "Frame",
    "Limits",
    "encode",
]

VERSION: Final = 1
OP_TELL, OP_ASK, OP_REPLY, OP_FAIL, OP_PING, OP_PART, OP_SHM = 1, 2, 3, 4, 5, 6, 7
_MESSAGE_OPS: Final = frozenset({OP_TELL, OP_ASK, OP_REPLY, OP_FAIL, OP_PING, OP_SHM})
FLAG_STREAMED: Final = 1
FLAG_SHM: Final = 2
"""The payload is in the sender's shared-memory ring; ``SHM_TRAILER`` after the header says where."""

FRAME_PREFIX: Final = struct.Struct("<BBHIIQ")
PART_PREFIX: Final = struct.Struct("<BBHI")
SHM_TRAILER: Final = struct.Struct("<QQ")
"""Offset of the payload in the ring, ring position after it."""
_pack_prefix = FRAME_PREFIX.pack
_unpack_prefix = FRAME_PREFIX.unpack_from

_EXT_REF, _EXT_TENSOR, _EXT_MESSAGE = 1, 2, 3
_ALIGN = 64
_ZEROS = bytes(_ALIGN)
_KIND_NUMPY, _KIND_TORCH = 0, 1

# dtype name -> numpy dtype (torch-only dtypes travel as same-sized ints)
_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    name: np.dtype(name)
    for name in (
        "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}
_TORCH_ONLY: Final = {"bfloat16": "int16"}
_MAX_NDIM = 32


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may send; anything beyond is a decode error."""

    max_message_bytes: int = 1 << 30
    """Largest tensor payload of one message."""
    max_header_bytes: int = 8 << 20
    """Largest msgpack header (plain fields) of one message."""
    part_bytes: int = 256 << 10
    """Payloads above this are streamed in parts of this size (256 KiB measured a little faster
    than 512 KiB and up on loopback: each part stays in cache through its copies)."""
    max_streams: int = 64
    """Streamed messages being assembled at once on one connection."""
    max_pending_bytes: int = 2 << 30
    """Bytes reserved at once for streamed messages being assembled on one connection."""
    max_depth: int = 32
    """Nesting depth of messages inside messages."""

    @property
    def max_ws_message(self) -> int:
        """The websocket ``max_msg_size`` that fits every frame these limits allow."""
        return FRAME_PREFIX.size + self.max_header_bytes + self.part_bytes


@dataclasses.dataclass(slots=True)
class Frame:
    """A decoded frame. ``error`` is set (and ``value`` None) when the frame
    was well formed but its message was not acceptable (e.g. unknown tag)."""

    op: int
    target: str
    sender: str | None
    corr: int
    value: Any
    error: DecodeError | None = None


class Encoded:
    """An encoded frame: the websocket messages to send, lazily for big ones."""

    __slots__ = ("header", "buffers", "payload_len")

    def __init__(self, header: bytes, buffers: list[memoryview | bytes], payload_len: int) -> None:
        self.header = header
        self.buffers = buffers
        self.payload_len = payload_len

    def single(self, op: int) -> bytes:
        """The frame as one websocket message (payload inline, not streamed)."""
        prefix = _pack_prefix(VERSION, op, 0, len(self.header), 0, self.payload_len)
        if not self.buffers:
            return prefix + self.header
        return b"".join((prefix, self.header, *self.buffers))

    def in_ring(self, op: int, offset: int, mark: int) -> bytes:
        """The frame as one websocket message whose payload was placed in the shared-memory ring."""
        prefix = _pack_prefix(VERSION, op, FLAG_SHM, len(self.header), 0, self.payload_len)
        return b"".join((prefix, self.header, SHM_TRAILER.pack(offset, mark)))

    def messages(self, op: int, stream_id: int, part_bytes: int) -> Iterator[bytes]:
        """The websocket messages of this frame; ``stream_id`` is used if it is streamed."""
        if self.payload_len <= part_bytes:
            yield self.single(op)
            return
        yield _pack_prefix(VERSION, op, FLAG_STREAMED, len(self.header), stream_id, self.payload_len) + self.header
        part_prefix = PART_PREFIX.pack(VERSION, OP_PART, 0, stream_id)
        chunk: list[memoryview | bytes] = [part_prefix]
        room = part_bytes
        for buf in self.buffers:
            view = memoryview(buf)
            while len(view):
                take = view[:room]
                chunk.append(take)
                room -= len(take)
                view = view[len(take):]
                if room == 0:
                    yield b"".join(chunk)
                    chunk = [part_prefix]
                    room = part_bytes
        if len(chunk) > 1:
            yield b"".join(chunk)


def _torch() -> Any:
    return sys.modules.get("torch")


class _Packer:
    """msgpack ``default`` hook: refs, tensors and nested messages."""

    __slots__ = ("buffers", "size")

    def __init__(self) -> None:
        self.buffers: list[memoryview | bytes] = []
        self.size = 0

    def __call__(self, obj: Any) -> Any:
        if isinstance(obj, ActorRef):
            return msgpack.ExtType(_EXT_REF, obj.address.encode())
        if isinstance(obj, np.ndarray):
            return self._tensor(obj, _KIND_NUMPY, obj.dtype.name)
        torch = _torch()
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._torch_tensor(obj, torch)
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, (tuple, set, frozenset)):
            return list(obj)
        try:
            spec = message_spec(type(obj))
        except KeyError:
            raise TypeError(
                f"cannot send a {type(obj).__qualname__}: use plain values, numpy arrays, CPU tensors, "
                "ActorRefs or @message classes"
            ) from None
        fields = [getattr(obj, name) for name in spec.field_names]
        return msgpack.ExtType(_EXT_MESSAGE, msgpack.packb([spec.tag, fields], default=self, use_bin_type=True))

    def _torch_tensor(self, tensor: Any, torch: Any) -> msgpack.ExtType:
        if tensor.device.type != "cpu":
            raise TypeError(f"tensors travel from CPU memory; move it first (tensor is on {tensor.device})")
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        name = str(tensor.dtype).removeprefix("torch.")
        if name in _TORCH_ONLY:
            array = tensor.view(getattr(torch, _TORCH_ONLY[name])).numpy()
        else:
            array = tensor.numpy()
        return self._tensor(array, _KIND_TORCH, name)

    def _tensor(self, array: np.ndarray[Any, Any], kind: int, dtype: str) -> msgpack.ExtType:
        if array.dtype.name not in _DTYPES:
            raise TypeError(f"dtype {array.dtype} cannot travel; use one of {sorted(_DTYPES)}")
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        nbytes = array.nbytes
        offset = self.size
        if nbytes:
            self.buffers.append(memoryview(array.data).cast("B") if array.ndim else array.tobytes())
        pad = -nbytes % _ALIGN
        if pad:
            self.buffers.append(_ZEROS[:pad])
        self.size += nbytes + pad
        desc = msgpack.packb([dtype, list(array.shape), nbytes, kind, offset])
        return msgpack.ExtType(_EXT_TENSOR, desc)


_layouts: dict[type, tuple[str, tuple[str, ...]]] = {}


def _layout(cls: type) -> tuple[str, tuple[str, ...]]:
    """(tag, field names) of a registered message class, cached per class object."""
    layout = _layouts.get(cls)
    if layout is None:
        try:
            spec = message_spec(cls)
        except KeyError:
            raise TypeError(
                f"{cls.__qualname__} is not a registered message: decorate it with @message('tag')"
            ) from None
        layout = _layouts[cls] = (spec.tag, spec.field_names)
    return layout


class _TopPacker:
    """One reusable msgpack ``Packer`` for headers; a fresh one if re-entered."""

    def __init__(self) -> None:
        self.hook = _Packer()
        self.packer = msgpack.Packer(default=self._default, use_bin_type=True)
        self.busy = False

    def _default(self, obj: Any) -> Any:
        return self.hook(obj)

    def pack(self, header: list[Any]) -> tuple[bytes, list[memoryview | bytes], int]:
        """The header's bytes, and the payload buffers and size of the tensors in it."""
        if self.busy:  # encoding from inside a hook: never share the buffer
            hook = _Packer()
            return msgpack.packb(header, default=hook, use_bin_type=True), hook.buffers, hook.size
        self.busy = True
        hook = self.hook
        try:
            data = self.packer.pack(header)
        except BaseException:
            self.packer.reset()
            self.hook = _Packer()
            raise
        finally:
            self.busy = False
        if not hook.buffers:
            return data, [], 0  # the hook saw no tensor: keep it for the next header
        self.hook = _Packer()
        return data, hook.buffers, hook.size


_top = _TopPacker()


def encode(op: int, target: str, corr: int, value: Any, sender: str | None = None) -> Encoded:
    """Encode one frame. For tells and asks ``value`` must be a registered message."""
    if op == OP_TELL or op == OP_ASK:
        tag, names = _layout(type(value))
        return Encoded(*_top.pack([tag, target, sender, corr, [getattr(value, name) for name in names]]))
    return Encoded(*_top.pack([None, target, sender, corr, value]))


# -- decoding ---------------------------------------------------------------


class _Stream:
    __slots__ = ("op", "header", "buffer", "filled")

    def __init__(self, op: int, header: bytes, size: int) -> None:
        self.op = op
        self.header = header
        self.buffer = memoryview(np.empty(size, dtype=np.uint8).data)  # no zero-fill: every byte is written
        self.filled = 0


RefResolver = Callable[[str], ActorRef]
_EMPTY: bytearray | memoryview = bytearray()


class Decoder:
    """Decodes the frames of one connection; holds its half-received streams."""

    def __init__(self, resolve_ref: RefResolver, limits: Limits = Limits()) -> None:
        self._resolve_ref = resolve_ref
        self.limits = limits
        self._streams: dict[int, _Stream] = {}
        self._pending = 0
        self._context = _Context(resolve_ref, limits.max_depth)
        self.ring: PeerRing | None = None
        """The peer's shared-memory ring, once it was offered and mapped."""

    @property
    def pending_bytes(self) -> int:
        """Bytes reserved for streamed messages not yet complete."""
        return self._pending

    def feed(self, data: bytes) -> Frame | None:
        """Decode one websocket message: a frame, or None for a part of one.

        Raises :class:`DecodeError` (``fatal``) when the bytes cannot be framed;
        a frame whose message is unacceptable comes back with ``error`` set.
        """
        size = len(data)
        if size < FRAME_PREFIX.size:
            if size >= PART_PREFIX.size and data[0] == VERSION and data[1] == OP_PART:
                return self._part(data)
            raise DecodeError(f"frame of {size} bytes is shorter than its prefix")
        version, op, flags, header_len, stream_id, payload_len = _unpack_prefix(data)
        if version != VERSION:
            raise DecodeError(f"unsupported protocol version {version} (this node speaks {VERSION})")
        if op == OP_PART:
            return self._part(data)
        if op not in _MESSAGE_OPS:
            raise DecodeError(f"unknown frame op {op}")
        limits = self.limits
        if header_len > limits.max_header_bytes:
            raise DecodeError(f"header of {header_len} bytes exceeds the limit {limits.max_header_bytes}")
        if payload_len > limits.max_message_bytes:
            raise DecodeError(f"payload of {payload_len} bytes exceeds the limit {limits.max_message_bytes}")
        start = FRAME_PREFIX.size
        end = start + header_len
        if flags & FLAG_STREAMED:
            if size != end:
                raise DecodeError(f"streamed frame: header announces {header_len} bytes, {size - start} sent")
            if payload_len == 0:
                raise DecodeError("streamed frame without payload")
            if stream_id in self._streams:
                raise DecodeError(f"stream {stream_id} is already open")
            if len(self._streams) >= limits.max_streams:
                raise DecodeError(f"more than {limits.max_streams} streamed messages at once")
            if self._pending + payload_len > limits.max_pending_bytes:
                raise DecodeError(f"streamed messages would hold more than {limits.max_pending_bytes} bytes")
            self._streams[stream_id] = _Stream(op, data[start:end], payload_len)
            self._pending += payload_len
            return None
        if flags & FLAG_SHM:
            ring = self.ring
            if ring is None:
                raise DecodeError("shared-memory frame on a connection without a ring")
            if size != end + SHM_TRAILER.size:
                raise DecodeError(f"shared-memory frame: header announces {header_len} bytes, {size - start} sent")
            offset, mark = SHM_TRAILER.unpack_from(data, end)
            return self._finish(op, data[start:end], ring.take(offset, payload_len, mark))
        if size != end + payload_len:
            raise DecodeError(
                f"truncated frame: prefix announces {header_len} + {payload_len} bytes, {size - start} sent"
            )
        payload = bytearray(memoryview(data)[end:]) if payload_len else _EMPTY
        return self._finish(op, data[start:end], payload)

    def _part(self, data: bytes) -> Frame | None:
        _, _, _, stream_id = PART_PREFIX.unpack_from(data)
        stream = self._streams.get(stream_id)
        if stream is None:
            raise DecodeError(f"part of unknown stream {stream_id}")
        chunk = memoryview(data)[PART_PREFIX.size :]
        end = stream.filled + len(chunk)
        if end > len(stream.buffer):
            raise DecodeError(f"stream {stream_id} sent more bytes than its prefix announced")
        stream.buffer[stream.filled : end] = chunk
        stream.filled = end
        if end < len(stream.buffer):
            return None
        del self._streams[stream_id]
        self._pending -= len(stream.buffer)
        return self._finish(stream.op, stream.header, stream.buffer)

    def _finish(self, op: int, raw: bytes, payload: bytearray | memoryview) -> Frame:
        context = self._context
        context.payload = payload
        context.used = 0
        context.depth = 0
        context.error = None
        try:
            header = msgpack.unpackb(raw, ext_hook=context.hook, raw=False, strict_map_key=False)
        except Exception as exc:
            raise DecodeError(f"malformed header: {type(exc).__name__}: {exc}") from None
        finally:
            context.payload = _EMPTY  # the tensors keep what they view; the context keeps nothing
        if not (type(header) is list and len(header) == 5):
            raise DecodeError("header is not [tag, target, sender, corr, body]")
        tag, target, sender, corr, body = header
        if type(target) is not str or not (sender is None or type(sender) is str):
            raise DecodeError("header target/sender is not a string")
        if type(corr) is not int or corr < 0:
            raise DecodeError("header correlation id is not a non-negative integer")
        try:
            if context.error is not None:
                raise context.error
            if context.used != len(payload):
                raise DecodeError(f"tensors cover {context.used} payload bytes, {len(payload)} were sent")
            if op == OP_TELL or op == OP_ASK:
                if type(tag) is not str:
                    raise DecodeError("tell/ask frame without a message tag")
                value = context.message(tag, body)
            else:
                value = body
                if op == OP_FAIL and not (
                    type(value) is list and len(value) == 2 and all(type(v) is str for v in value)
                ):
                    raise DecodeError("error frame body is not [type, message]")
        except DecodeError as exc:
            exc.fatal = False  # framing was sound: only this message is lost
            return Frame(op, target, sender, corr, None, exc)
        return Frame(op, target, sender, corr, value)


class _Context:
    """A frame's decoding (reset per frame): its payload, the ref resolver, the nesting depth.

    Errors inside msgpack's extension hook are kept (and a placeholder
    returned) so the header still yields the correlation id to answer with.
    """

    __slots__ = ("resolve_ref", "payload", "used", "depth", "max_depth", "hook", "error")

    def __init__(self, resolve_ref: RefResolver, max_depth: int) -> None:
        self.resolve_ref = resolve_ref
        self.payload = _EMPTY
        self.used = 0
        self.depth = 0
        self.max_depth = max_depth
        self.hook = self._ext
        self.error: DecodeError | None = None

    def _ext(self, code: int, data: bytes) -> Any:
        try:
            if code == _EXT_REF:
                try:
                    return self.resolve_ref(data.decode())
                except Exception as exc:
                    raise DecodeError(f"bad actor ref {data[:80]!r}: {exc}") from None
            if code == _EXT_TENSOR:
                return self._tensor(data)
            if code == _EXT_MESSAGE:
                return self._nested(data)
            raise DecodeError(f"unknown extension type {code}")
        except DecodeError as exc:
            if self.error is None:
                self.error = exc
            return None

    def _nested(self, data: bytes) -> Any:
        self.depth += 1
        try:
            if self.depth > self.max_depth:
                raise DecodeError(f"messages nested deeper than {self.max_depth}")
            try:
                inner = msgpack.unpackb(data, ext_hook=self.hook, raw=False, strict_map_key=False)
            except Exception as exc:
                raise DecodeError(f"malformed nested message: {type(exc).__name__}: {exc}") from None
            if self.error is not None:
                raise self.error
            if not (type(inner) is list and len(inner) == 2 and type(inner[0]) is str):
                raise DecodeError("nested message is not [tag, fields]")
            return self.message(inner[0], inner[1])
        finally:
            self.depth -= 1

    def _tensor(self, data: bytes) -> Any:
        try:
            desc = msgpack.unpackb(data, raw=False)
        except Exception:
            raise DecodeError("malformed tensor descriptor") from None
        if not (type(desc) is list and len(desc) == 5):
            raise DecodeError("tensor descriptor is not [dtype, shape, nbytes, kind, offset]")
        dtype, shape, nbytes, kind, offset = desc
        if type(dtype) is not str or (dtype not in _DTYPES and dtype not in _TORCH_ONLY):
            raise DecodeError(f"unsupported tensor dtype {str(dtype)[:40]!r}")
        if kind != _KIND_NUMPY and kind != _KIND_TORCH:
            raise DecodeError(f"unknown tensor kind {kind!r}")
        if dtype in _TORCH_ONLY and kind != _KIND_TORCH:
            raise DecodeError(f"dtype {dtype} is only valid for torch tensors")
        if type(shape) is not list or len(shape) > _MAX_NDIM:
            raise DecodeError("tensor shape is not a list of at most 32 dimensions")
        count = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise DecodeError(f"tensor dimension {dim!r} is not a non-negative integer")
            count *= dim
        base = _DTYPES[_TORCH_ONLY.get(dtype, dtype)]
        if type(nbytes) is not int or nbytes != count * base.itemsize:
            raise DecodeError(f"tensor nbytes {nbytes!r} != {dtype} x {shape} = {count * base.itemsize}")
        if offset != self.used:
            raise DecodeError(f"tensor offset {offset!r} is not the next free payload byte ({self.used})")
        end = offset + nbytes
        if end > len(self.payload):
            raise DecodeError(f"tensor needs payload bytes up to {end}, {len(self.payload)} were sent")
        self.used = end + (-nbytes % _ALIGN)
        array = np.frombuffer(self.payload, dtype=base, count=count, offset=offset).reshape(shape)
        if kind == _KIND_NUMPY:
            return array
        import torch

        tensor = torch.from_numpy(array) if count else torch.empty(shape, dtype=getattr(torch, base.name))
        return tensor.view(getattr(torch, dtype)) if dtype in _TORCH_ONLY else tensor

    def message(self, tag: str, fields: Any) -> Any:
        return _schema(tag).build(tag, fields)
