"""Swappable gradient codecs: one interface over the Rust quantizers in ``dniasync._core``.

Every codec turns a float32 gradient into a :class:`CompressedTensor` (raw bytes plus the
codec name and shape) with :meth:`Codec.compress`, back into a dense array with
:meth:`Codec.extract`, or straight into a :class:`~dniasync._core.ParamStore` optimizer step
with :meth:`Codec.apply` (no dense intermediate). :meth:`Codec.estimate_compression_ratio`
says how many times smaller than float32 the payloads are, so callers can pick a codec.

Codecs with memory (``threshold``'s residual, ``onebit``'s carried error) belong to one
sender and one stream: make one codec per (tensor, destination). Receivers only need a
codec of the same kind and parameters to call ``extract`` or ``apply``.

Semantics of ``threshold`` (Strom 2015): each element whose accumulated value reaches
+-tau is sent as +-tau exactly (not +-1), the rest stays in the sender's residual.

:class:`DeltaCodec` uses the same codecs the other way: a PS shard sends a replica
quantized parameter deltas instead of its dense parameters.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from math import prod
from typing import ClassVar, Literal

import numpy as np
from numpy.typing import NDArray

from dniasync import _core

__all__ = [
    "AUTO_DELTA_TAU_FRACTION",
    "Codec",
    "CodecName",
    "CompressedTensor",
    "DeltaCodec",
    "Int8Codec",
    "NoneCodec",
    "OneBitCodec",
    "ThresholdCodec",
    "make_codec",
    "values_digest",
]

CodecName = Literal["none", "threshold", "onebit", "int8"]


@dataclass(frozen=True, slots=True)
class CompressedTensor:
    """A codec's payload and what a receiver needs to read it."""

    codec: str
    shape: tuple[int, ...]
    payload: NDArray[np.uint8]

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)


def _aligned_view(payload: NDArray[np.uint8], dtype: type[np.generic]) -> NDArray[np.generic]:
    """Reinterpret bytes as ``dtype``, copying only when the buffer is misaligned."""
    itemsize = np.dtype(dtype).itemsize
    if payload.nbytes % itemsize:
        raise ValueError(f"payload of {payload.nbytes} bytes is not a whole number of {dtype.__name__}")
    flat = np.ascontiguousarray(payload).reshape(-1)
    if flat.ctypes.data % itemsize:
        flat = flat.copy()
    return flat.view(dtype)


class Codec(ABC):
    """Compresses gradients of one fixed shape."""

    name: ClassVar[str]

    def __init__(self, shape: int | tuple[int, ...]) -> None:
        self.shape: tuple[int, ...] = (shape,) if isinstance(shape, int) else tuple(shape)
        self.n: int = prod(self.shape)

    @abstractmethod
    def compress(self, grad: NDArray[np.float32]) -> CompressedTensor:
        """Encode ``grad`` (float32, C-contiguous, ``n`` elements), updating codec state."""

    @abstractmethod
    def extract(self, compressed: CompressedTensor) -> NDArray[np.float32]:
        """Decode into a new dense float32 array of ``shape``."""

    @abstractmethod
    def apply(
        self, store: _core.ParamStore, segment: str, compressed: CompressedTensor, lr: float
    ) -> int:
        """One optimizer step of ``store[segment]`` with the decoded gradient; the new version."""

    @abstractmethod
    def add_to(
        self, store: _core.ParamStore, segment: str, compressed: CompressedTensor, alpha: float = 1.0
    ) -> int:
        """``store[segment] += alpha * decoded`` (no optimizer; the threshold codec touches only the coded
        elements), decoded chunk by chunk; the new version."""

    @abstractmethod
    def estimate_compression_ratio(self) -> float:
        """Expected float32 bytes over payload bytes."""

    def _check(self, compressed: CompressedTensor) -> NDArray[np.uint8]:
        if compressed.codec != self.name:
            raise ValueError(f"payload was made by codec {compressed.codec!r}, not {self.name!r}")
        if compressed.shape != self.shape:
            raise ValueError(f"payload has shape {compressed.shape}, codec expects {self.shape}")
        return compressed.payload

    def _wrap(self, payload: NDArray[np.uint8]) -> CompressedTensor:
        return CompressedTensor(self.name, self.shape, payload)


class NoneCodec(Codec):
    """Identity: the float32 bytes themselves (ratio 1), for comparison and small tensors."""

    name = "none"

    def compress(self, grad: NDArray[np.float32]) -> CompressedTensor:
        if not isinstance(grad, np.ndarray) or grad.dtype != np.float32:
            raise TypeError(f"grad must be a numpy.ndarray of float32, got {getattr(grad, 'dtype', type(grad))}")
        if not grad.flags.c_contiguous:
            raise ValueError("grad must be C-contiguous (numpy.ascontiguousarray makes a contiguous copy)")
        if grad.size != self.n:
            raise ValueError(f"gradient: expected {self.n} elements, got {grad.size}")
        return self._wrap(grad.reshape(-1).copy().view(np.uint8))

    def extract(self, compressed: CompressedTensor) -> NDArray[np.float32]:
        values = _aligned_view(self._check(compressed), np.float32)
        return np.array(values, dtype=np.float32).reshape(self.shape)

    def apply(
        self, store: _core.ParamStore, segment: str, compressed: CompressedTensor, lr: float
    ) -> int:
        values = _aligned_view(self._check(compressed), np.float32)
        return store.step(segment, values.astype(np.float32, copy=False), lr)

    def add_to(
        self, store: _core.ParamStore, segment: str, compressed: CompressedTensor, alpha: float = 1.0
    ) -> int:
        values = _aligned_view(self._check(compressed), np.float32)
        return store.add(segment, values.astype(np.float32, copy=False), alpha)

    def estimate_compression_ratio(self) -> float:
        return 1.0


class ThresholdCodec(Codec):
    """Strom threshold quantization: +-tau per element that crossed it, residual kept here.

    The payload is the packed uint32 codes (bit 31 sign, 31-bit index). Its size depends on
    the data; ``estimate_compression_ratio`` reports the last payload's ratio, or
    ``1 / expected_density`` before the first one.
    """

    name = "threshold"

    def __init__(
        self, shape: int | tuple[int, ...], tau: float, expected_density: float = 0.01
    ) -> None:
        super().__init__(shape)
        if not 0.0 < expected_density <= 1.0:
            raise ValueError(f"expected_density must be in (0, 1], got {expected_density}")
        self._core = _core.ThresholdCodec(self.n, tau)
        self._ratio = 1.0 / expected_density

    @property
    def tau(self) -> float:
        return self._core.tau

    def residual(self) -> NDArray[np.float32]:
        return self._core.residual().reshape(self.shape)

    def compress(self, grad: NDArray[np.float32]) -> CompressedTensor:
        codes = self._core.encode(grad)
        self._ratio = self._core.compression_ratio(codes)
        return self._wrap(codes.view(np.uint8))

    def compress_capped(self, grad: NDArray[np.float32], max_codes: int,
                        start: int) -> tuple[CompressedTensor, int]:
        """:meth:`compress`, but at most ``max_codes`` codes: those from element ``start`` on (wrapping); the
        other elements that reached +-tau keep it in the residual for a later payload. Returns the payload and
        the element a next call starts from (``start`` if nothing was left out): round-robin over the vector."""
        codes, nxt = self._core.encode_capped(grad, max_codes, start)
        self._ratio = self._core.compression_ratio(codes)
        return self._wrap(codes.view(np.uint8)), int(nxt)

    def _codes(self, compressed: CompressedTensor) -> NDArray[np.uint32]:
        codes: NDArray[np.uint32] = _aligned_view(self._check(compressed), np.uint32).astype(
            np.uint32, copy=False
        )
        return codes

    def extract(self, compressed: CompressedTensor) -> NDArray[np.float32]:
        return self._core.decode(self._codes(compressed)).reshape(self.shape)

    def apply(
        self, store: _core.ParamStore, segment: str, compressed: CompressedTensor, lr: float
    ) -> int:
        return self._core.apply(store, segment, self._codes(compressed), lr)

    def add_to(
        self, store: _core.ParamStore, segment: str, compressed: CompressedTensor, alpha: float = 1.0
    ) -> int:
        return self._core.add_to(store, segment, self._codes(compressed), alpha)

    def estimate_compression_ratio(self) -> float:
        return self._ratio


class OneBitCodec(Codec):
    """1-bit SGD with error feedback (sign bit per element, two means per block)."""

    name = "onebit"

    def __init__(self, shape: int | tuple[int, ...], block: int = 256) -> None:
        super().__init__(shape)
        self._core = _core.OneBitCodec(self.n, block)

    def error(self) -> NDArray[np.float32]:
        return self._core.error().reshape(self.shape)

    def compress(self, grad: NDArray[np.float32]) -> CompressedTensor:
        return self._wrap(self._core.encode(grad))

    def extract(self, compressed: CompressedTensor) -> NDArray[np.float32]:
        return self._core.decode(self._check(compressed)).reshape(self.shape)

    def apply(
        self, store: _core.ParamStore, segment: str, compressed: CompressedTensor, lr: float
    ) -> int:
        return self._core.apply(store, segment, self._check(compressed), lr)

    def add_to(
        self, store: _core.ParamStore, segment: str, compressed: CompressedTensor, alpha: float = 1.0
    ) -> int:
        return self._core.add_to(store, segment, self._check(compressed), alpha)

    def estimate_compression_ratio(self) -> float:
        return self._core.compression_ratio()


class Int8Codec(Codec):
    """8-bit blockwise quantization with a float32 scale per block (stateless)."""

    name = "int8"

    def __init__(self, shape: int | tuple[int, ...], block: int = 256) -> None:
        super().__init__(shape)
        self._core = _core.Int8Codec(self.n, block)

    def compress(self, grad: NDArray[np.float32]) -> CompressedTensor:
        return self._wrap(self._core.encode(grad))

    def extract(self, compressed: CompressedTensor) -> NDArray[np.float32]:
        return self._core.decode(self._check(compressed)).reshape(self.shape)

    def apply(
        self, store: _core.ParamStore, segment: str, compressed: CompressedTensor, lr: float
    ) -> int:
        return self._core.apply(store, segment, self._check(compressed), lr)

    def add_to(
        self, store: _core.ParamStore, segment: str, compressed: CompressedTensor, alpha: float = 1.0
    ) -> int:
        return self._core.add_to(store, segment, self._check(compressed), alpha)

    def estimate_compression_ratio(self) -> float:
        return self._core.compression_ratio()


def make_codec(
    name: CodecName,
    shape: int | tuple[int, ...],
    *,
    tau: float = 1e-3,
    block: int = 256,
    expected_density: float = 0.01,
) -> Codec:
    """The codec called ``name`` for gradients of ``shape`` (options apply where they mean something)."""
    if name == "none":
        return NoneCodec(shape)
    if name == "threshold":
        return ThresholdCodec(shape, tau, expected_density)
    if name == "onebit":
        return OneBitCodec(shape, block)
    if name == "int8":
        return Int8Codec(shape, block)
    raise ValueError(f"unknown codec {name!r}: expected none, threshold, onebit or int8")


AUTO_DELTA_TAU_FRACTION = 0.1
"""Default threshold of pulled parameter deltas: this fraction of the shard's parameter RMS (:class:`DeltaCodec`)."""


def values_digest(values: NDArray[np.float32]) -> str:
    """A digest of float32 ``values``, bit for bit: a replica and a PS shard compare their copies with it."""
    return hashlib.blake2b(np.ascontiguousarray(values, dtype=np.float32).tobytes(), digest_size=16).hexdigest()


class DeltaCodec:
    """Parameter deltas from a PS shard to a replica, coded with one of the gradient codecs.

    The shard keeps what the replica holds (``known``) and sends ``code(current - known)``;
    both sides add the same :meth:`decode` to their copy, so the replica's parameters equal
    the shard's ``known`` bit for bit. What a message leaves out stays in ``current - known``
    and goes with a later one: that difference is the error feedback, so no codec keeps a
    residual of its own here.

    ``threshold`` codes each element whose difference reached the threshold once, as its
    index and its whole number of thresholds (``trunc(diff / tau)``): two parts, the indices
    (uint32, ascending) and the counts (int8, or int16 when an element moved 128 thresholds
    or more). That is 5 bytes per element that moved, however far it moved. (Strom's one
    code of +-tau per element and message suits gradients, which a residual accumulates; a
    copy that lags by k thresholds would need k such codes, 4k bytes.) Where those parts
    would be larger than the ``int8`` message (1 byte per element plus a scale per
    ``block``: early in training, when nearly every weight moves past the threshold between
    two pulls), the answer is ``int8`` instead, named in the message: a quarter of a dense
    copy.

    Right after a delta, each element of ``current - known`` is bounded by:

    - ``threshold``: less than the answer's threshold (up to float32 rounding);
    - ``int8`` (also a ``threshold`` link's fallback): half a quantization step,
      ``max|diff| / 254`` over the element's block (plus float32 rounding);
    - ``onebit``: ``max|diff|`` over the element's block (each sign gets its block's mean).

    The threshold (:meth:`threshold_for`) is ``tau`` when given. By default (``tau=None``) it
    is ``tau_fraction`` (10%) of the root mean square of the shard's parameters at the time
    of the answer, so it follows the scale of the weights it approximates: after each pull
    every element of the replica's copy is within a tenth of the typical weight, whatever
    the model, its init or how far training has moved it. A fixed threshold cannot do that:
    the pushes' ``tau`` (the old default), say 0.2, against weights of RMS 0.02 leaves a copy
    off by ten times the weights (784-64-10 MLP on mnist5k, 4 replicas, 3 epochs: 58%
    held out against 92% uncompressed).

    Why 10%: the threshold trades bytes against the copy's error. Measured on that job with
    the one-code-per-threshold coding this class used before (threshold pushes at tau
    0.2 / 0.01): 1% of the RMS compressed nothing; 5% cut pulled bytes 12x; 10% 27x / 8x
    with held-out accuracy that of dense pulls within run-to-run noise; 30% 40x but cost
    about 1 point. Why the weights and not the gap between the copies (a threshold adapted
    to how far each replica's copy lags)? What the copy's error costs is its size relative
    to the weights; a gap-driven threshold grows with the updates, so the fast early phase
    of training would get the coarsest copies.

    The threshold travels with each answer (``ParamsDelta.tau``) and the replica decodes
    with the shard's value; a decode is whole counts times the threshold: the same float32
    on both sides.

    :meth:`encode` returns None where the answer is a dense copy: the threshold is not a
    positive finite number (as for all-zero parameters), or an element moved 32,768
    thresholds or more.
    """

    def __init__(self, name: CodecName, n: int, *, tau: float | None = None, block: int = 256,
                 tau_fraction: float = AUTO_DELTA_TAU_FRACTION) -> None:
        if name == "none":
            raise ValueError("parameter deltas need a quantizing codec; 'none' pulls dense parameters")
        if tau is not None and not (tau > 0.0 and np.isfinite(tau)):
            raise ValueError(f"delta tau must be positive and finite (or None for auto), got {tau}")
        if not 0.0 < tau_fraction < np.inf:
            raise ValueError(f"tau_fraction must be positive, got {tau_fraction}")
        self.name = name
        self.n = n
        self.tau = tau
        self.tau_fraction = tau_fraction
        self._onebit = _core.OneBitCodec(n, block) if name == "onebit" else None
        # int8: the codec itself, or the threshold coding's fallback where its parts would be larger
        self._int8 = _core.Int8Codec(n, block) if name in ("int8", "threshold") else None
        self._int8_bytes = n + 4 * -(-n // block)

    def threshold_for(self, current: NDArray[np.float32]) -> float:
        """The threshold of an answer bringing a copy to ``current``: ``tau``, or ``tau_fraction`` of its RMS.

        0.0 for the codecs without a threshold (``int8`` and ``onebit`` scale per block).
        """
        if self.name != "threshold":
            return 0.0
        if self.tau is not None:
            return self.tau
        flat = current.reshape(-1)
        rms = float(np.sqrt(np.dot(flat, flat) / max(flat.size, 1)))
        return float(np.float32(self.tau_fraction * rms))

    def encode(self, diff: NDArray[np.float32],
               tau: float = 0.0) -> tuple[CodecName, list[NDArray[np.uint8]]] | None:
        """The answer's codec and the parts coding ``diff`` (float32, ``n`` elements) with threshold ``tau``
        (``threshold`` only), or None if the answer is dense."""
        diff = np.ascontiguousarray(diff, dtype=np.float32)
        if self.name == "threshold":
            if not (tau > 0.0 and np.isfinite(tau)):
                return None
            counts = np.trunc(diff / np.float32(tau))
            index = np.flatnonzero(counts)
            moved = counts[index]
            largest = float(np.abs(moved).max()) if index.size else 0.0
            if largest >= 32768:
                return None
            width = np.int8 if largest < 128 else np.int16
            if index.size * (4 + np.dtype(width).itemsize) < self._int8_bytes:
                return "threshold", [index.astype(np.uint32).view(np.uint8), moved.astype(width).view(np.uint8)]
        elif self._onebit is not None:
            self._onebit.reset()
            return "onebit", [self._onebit.encode(diff)]
        assert self._int8 is not None
        return "int8", [self._int8.encode(diff)]

    def decode(self, parts: list[NDArray[np.uint8]], tau: float = 0.0,
               codec: str | None = None) -> NDArray[np.float32]:
        """The dense delta ``parts`` code (what both sides add to their copy); ``tau``: the encode's
        threshold; ``codec``: the answer's (default: this link's own)."""
        codec = self.name if codec is None else codec
        if codec == "threshold" and self.name == "threshold":
            if len(parts) != 2:
                raise ValueError(f"a threshold delta is two parts (indices, counts), got {len(parts)}")
            index = _aligned_view(parts[0], np.uint32)
            out = np.zeros(self.n, dtype=np.float32)
            if index.size:
                width = parts[1].nbytes // index.size
                if width not in (1, 2) or parts[1].nbytes != width * index.size:
                    raise ValueError(f"a threshold delta of {index.size} indices has {parts[1].nbytes} count bytes")
                counts = _aligned_view(parts[1], np.int8 if width == 1 else np.int16)
                out[index] = counts.astype(np.float32) * np.float32(tau)
            return out
        if len(parts) != 1:
            raise ValueError(f"a {codec} delta is one part, got {len(parts)}")
        core = self._onebit if codec == "onebit" else self._int8 if codec == "int8" else None
        if core is None:
            raise ValueError(f"a {self.name} link cannot decode a {codec} delta")
        return core.decode(np.ascontiguousarray(parts[0], dtype=np.uint8).reshape(-1))
