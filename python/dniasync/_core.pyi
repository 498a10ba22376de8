"""Typed stub of the Rust extension ``dniasync._core`` (hand-written, checked by stubtest).

Arrays are numpy arrays of the stated dtype; they must be C-contiguous and are read flat
(any shape). Errors:

- ``TypeError``: not a numpy array, or the wrong dtype;
- ``ValueError``: non-contiguous array, length mismatch, bad argument;
- ``KeyError``: unknown segment;
- ``NonFiniteGradientError`` (a ``ValueError``): NaN/Inf in a gradient, update rejected
  and counted (``ParamStore.rejected_nonfinite``) unless the policy is ``"allow"``;
- ``LayoutMismatchError`` (a ``ValueError``): attaching to a shared store whose layout
  differs from the one given;
- ``FileExistsError`` / ``FileNotFoundError`` / ``OSError``: shared-memory file problems.

Every call on more than ~4 KB releases the GIL.
"""

from collections.abc import Sequence
from types import TracebackType
from typing import Literal, TypeAlias, final

import numpy as np
from numpy.typing import NDArray

__version__: str
__all__ = [
    "__version__",
    "BlockRows",
    "Int8Codec",
    "LayoutMismatchError",
    "NonFiniteGradientError",
    "OneBitCodec",
    "ParamStore",
    "ThresholdCodec",
    "gather_rows_u8",
    "kernel_isa",
    "kernel_isas",
    "set_kernel_isa",
    "vec_abs_sum_max",
    "vec_add_scaled",
    "vec_axpy",
    "vec_dot",
    "vec_dots",
    "vec_lincomb",
    "vec_scale",
]

_OptimizerName: TypeAlias = Literal["sgd", "momentum", "nesterov", "adagrad", "adam"]
_NonFinitePolicy: TypeAlias = Literal["reject", "allow"]
_Isa: TypeAlias = Literal["avx512", "avx2", "base"]

def kernel_isa() -> _Isa:
    """Instruction set the kernels run with now: the CPU's widest, capped by
    ``DNIASYNC_ISA=avx2|base`` and by ``set_kernel_isa``."""

def kernel_isas() -> list[_Isa]:
    """Every instruction set the kernels can run with here (within ``DNIASYNC_ISA``),
    narrowest first. Every one gives bit-identical results."""

def set_kernel_isa(isa: _Isa | None) -> None:
    """Caps the kernels of this process at ``isa`` (``None`` lifts the cap), to compare
    instruction sets in one run. ``ValueError`` if ``isa`` is not in ``kernel_isas()``."""

class NonFiniteGradientError(ValueError):
    """A gradient contained NaN or Inf; the update was rejected and counted."""

class LayoutMismatchError(ValueError):
    """A shared-memory store exists with a different layout than the one expected."""

@final
class ParamStore:
    """Flat float32 parameters in named, versioned segments, updated in place without locks.

    Hogwild semantics: concurrent updates of one element may overwrite each other (no
    undefined behaviour: every cell is a relaxed atomic), except through ``add_exact``.
    Optimizer state lives in the same store (``state_slots`` arrays after the parameters).
    With ``shm_name`` the store is the file ``/dev/shm/dniasync-<shm_name>``, which other
    processes map with ``ParamStore.attach``; the creating process removes it on ``close``
    (or when the store is garbage collected).
    """

    def __new__(
        cls,
        segments: Sequence[tuple[str, int]],
        optimizer: _OptimizerName = "sgd",
        *,
        momentum: float = 0.9,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float | None = None,
        weight_decay: float = 0.0,
        clip_norm: float | None = None,
        shm_name: str | None = None,
        nonfinite: _NonFinitePolicy = "reject",
    ) -> ParamStore: ...
    @staticmethod
    def attach(
        shm_name: str,
        segments: Sequence[tuple[str, int]] | None = None,
        optimizer: _OptimizerName | None = None,
        *,
        momentum: float = 0.9,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float | None = None,
        weight_decay: float = 0.0,
        clip_norm: float | None = None,
        nonfinite: _NonFinitePolicy = "reject",
    ) -> ParamStore:
        """Map a shared store; raise LayoutMismatchError unless it has the given segments/optimizer."""
    @staticmethod
    def is_stale(shm_name: str) -> bool:
        """True when the shared store exists and the process that created it is gone."""
    @staticmethod
    def remove_stale(shm_name: str) -> bool:
        """Remove the shared store if stale; return whether it was removed."""
    @property
    def segments(self) -> list[tuple[str, int, int]]:
        """(name, offset, length) of every segment, in order."""
    @property
    def optimizer(self) -> _OptimizerName: ...
    @property
    def state_slots(self) -> int: ...
    @property
    def shm_name(self) -> str | None: ...
    @property
    def is_owner(self) -> bool: ...
    @property
    def nonfinite_policy(self) -> _NonFinitePolicy: ...
    def set_nonfinite_policy(self, policy_name: _NonFinitePolicy) -> None: ...
    @property
    def rejected_nonfinite(self) -> int: ...
    def __len__(self) -> int: ...
    def version(self, segment: str) -> int:
        """Updates applied to the segment so far; every update bumps it."""
    def steps(self, segment: str) -> int:
        """Optimizer steps applied to the segment (Adam's bias-correction count)."""
    def set_steps(self, segment: str, steps: int) -> None:
        """Set the segment's step count: a store that takes over another's parameters and optimizer state
        continues its count, so Adam's bias correction is the one that state was built with."""
    def view(self, segment: str | None = None, state: int = 0) -> NDArray[np.float32]:
        """Zero-copy writable view of a segment (all parameters when None); state 1.. = optimizer state.

        The array keeps the store alive. It sees every update as it lands (no version
        guarantee: use ``read_into`` for a consistent copy); writes through it race with
        concurrent updates exactly like Hogwild updates do.
        """
    def read_into(self, segment: str, out: NDArray[np.float32], state: int = 0) -> int:
        """Copy the segment into ``out``; return the version read (all updates up to it are in)."""
    def write(self, segment: str, values: NDArray[np.float32], state: int = 0) -> int:
        """Overwrite the segment; return the new version."""
    def step(self, segment: str, grad: NDArray[np.float32], lr: float) -> int:
        """One fused optimizer step (weight decay, clipping, update); return the new version.

        ``lr`` is per call (divide it by the staleness if you like). Under the default
        ``"reject"`` policy the gradient is scanned first and a NaN/Inf raises
        NonFiniteGradientError, leaving the store untouched.
        """
    def step_into(self, segment: str, grad: NDArray[np.float32], lr: float, out: NDArray[np.float32]) -> int:
        """``step``, the parameters left as they are: ``out`` receives the change the step would make to each
        (the new value, rounded as ``step`` rounds it, minus the old) and the optimizer state advances as ``step``
        advances it; return the version, unchanged. ``out``: float32, contiguous, the segment's length."""
    def step_spans(self, segment: str, spans: NDArray[np.uint32], values: NDArray[np.float32], lr: float) -> int:
        """One optimizer step whose gradient is ``values`` over ``spans`` and zero elsewhere; the new version.

        ``spans``: ``[k, 2]`` uint32 ``(start, length)``, ascending, disjoint, inside the segment; ``values``: the
        elements they cover, span after span. With SGD or Adagrad and no weight decay only the spans are read and
        written (a zero gradient changes nothing there); otherwise the dense step over the scattered gradient.
        Either way the parameters end as ``step`` leaves them. ValueError for spans that do not fit.
        """
    def add(self, segment: str, delta: NDArray[np.float32], alpha: float = 1.0) -> int:
        """Hogwild ``w += alpha * delta``; return the new version."""
    def add_exact(self, segment: str, delta: NDArray[np.float32], alpha: float = 1.0) -> int:
        """``w += alpha * delta`` by compare-and-swap, losing nothing to concurrent adds."""
    def close(self) -> None:
        """Remove the shared-memory name if this process created it; views stay valid."""
    def __enter__(self) -> ParamStore: ...
    def __exit__(
        self,
        _exc_type: type[BaseException] | None,
        _exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> bool: ...

@final
class ThresholdCodec:
    """Strom threshold quantizer with a sender residual.

    ``encode`` adds the gradient to the residual and emits, for every element whose residual
    reaches +-tau, one uint32 code (bit 31 = sign, bits 0-30 = index, ascending), subtracting
    +-tau from the residual. Decoding yields exactly +-tau (not +-1) at coded indices.
    """

    def __new__(cls, n: int, tau: float) -> ThresholdCodec: ...
    @property
    def n(self) -> int: ...
    @property
    def tau(self) -> float: ...
    def encode(self, grad: NDArray[np.float32]) -> NDArray[np.uint32]: ...
    def decode(self, codes: NDArray[np.uint32]) -> NDArray[np.float32]: ...
    def apply(
        self, store: ParamStore, segment: str, codes: NDArray[np.uint32], lr: float
    ) -> int:
        """Optimizer step of ``store`` with the decoded gradient, never materialised densely."""
    def add_to(
        self, store: ParamStore, segment: str, codes: NDArray[np.uint32], alpha: float = 1.0
    ) -> int:
        """``w += alpha * decoded`` touching only the coded elements."""
    def residual(self) -> NDArray[np.float32]:
        """Copy of the residual."""
    def reset(self) -> None: ...
    def encode_capped(
        self, grad: NDArray[np.float32], max_codes: int, start: int
    ) -> tuple[NDArray[np.uint32], int]:
        """``encode``, but at most ``max_codes`` codes, from element ``start`` on (wrapping); the
        others keep their +-tau in the residual. Returns the codes and where a next call starts."""
    def compression_ratio(self, codes: NDArray[np.uint32]) -> float: ...

@final
class OneBitCodec:
    """1-bit SGD with error feedback: a sign bit per element, per block the means of the
    non-negative and of the negative values; the quantization error is carried here.
    Payload (uint8): per block two little-endian float32 means, then the bits (LSB first)."""

    def __new__(cls, n: int, block: int = 256) -> OneBitCodec: ...
    @property
    def n(self) -> int: ...
    @property
    def block(self) -> int: ...
    def encode(self, grad: NDArray[np.float32]) -> NDArray[np.uint8]: ...
    def decode(self, payload: NDArray[np.uint8]) -> NDArray[np.float32]: ...
    def apply(
        self, store: ParamStore, segment: str, payload: NDArray[np.uint8], lr: float
    ) -> int: ...
    def add_to(
        self, store: ParamStore, segment: str, payload: NDArray[np.uint8], alpha: float = 1.0
    ) -> int: ...
    def error(self) -> NDArray[np.float32]:
        """Copy of the carried quantization error."""
    def reset(self) -> None: ...
    def compression_ratio(self) -> float: ...

@final
class Int8Codec:
    """8-bit blockwise quantizer (stateless): per block one float32 scale (max|g|/127),
    one int8 per element. Payload (uint8): the little-endian scales, then the codes."""

    def __new__(cls, n: int, block: int = 256) -> Int8Codec: ...
    @property
    def n(self) -> int: ...
    @property
    def block(self) -> int: ...
    def encode(self, grad: NDArray[np.float32]) -> NDArray[np.uint8]: ...
    def decode(self, payload: NDArray[np.uint8]) -> NDArray[np.float32]: ...
    def apply(
        self, store: ParamStore, segment: str, payload: NDArray[np.uint8], lr: float
    ) -> int: ...
    def add_to(
        self, store: ParamStore, segment: str, payload: NDArray[np.uint8], alpha: float = 1.0
    ) -> int: ...
    def compression_ratio(self) -> float: ...

# -- float64 vector kernels of Sandblaster L-BFGS (run by each PS shard on its slice) --------

def gather_rows_u8(src: NDArray[np.uint8], offsets: NDArray[np.int64], row_len: int, scale: float,
                   out: NDArray[np.float32]) -> None:
    """Rows of ``row_len`` uint8 features starting at byte ``offsets[i]`` of ``src`` into ``out`` (float32,
    ``len(offsets) * row_len`` elements), each divided by ``scale``: numpy's ``np.divide(x, np.float32(scale),
    dtype=np.float32)`` bit for bit, in one pass with the GIL released. ValueError for a row outside ``src``."""

@final
class BlockRows:
    """A shard's batches read straight from its files' mappings: positions from ``bounds[j]`` to the next bound are
    consecutive rows of file ``file[j]`` (-1: not served here), position ``p``'s uint8 features at byte
    ``x[j] + p * row_len`` of ``srcs[file[j]]`` and its int64 label at ``y[j] + 8 * p``."""

    def __new__(cls, srcs: Sequence[NDArray[np.uint8] | None], bounds: Sequence[int], file: Sequence[int],
                x: Sequence[int], y: Sequence[int], row_len: int, scale: float) -> BlockRows: ...
    def take(self, positions: NDArray[np.int64], out_x: NDArray[np.float32], out_y: NDArray[np.int64]) -> bool:
        """The batch into ``out_x`` (divided by ``scale``, as :func:`gather_rows_u8`) and ``out_y``, the GIL
        released; False where a position is not served here (nothing to rely on in the outputs then)."""

def vec_dot(a: NDArray[np.float64], b: NDArray[np.float64]) -> float:
    """``a · b``."""

def vec_dots(a: Sequence[NDArray[np.float64]], b: Sequence[NDArray[np.float64]]) -> list[float]:
    """``[a[i] · b[i] for i]``, with the GIL released once."""

def vec_axpy(alpha: float, x: NDArray[np.float64], y: NDArray[np.float64]) -> None:
    """``y += alpha · x`` in place."""

def vec_scale(alpha: float, x: NDArray[np.float64]) -> None:
    """``x *= alpha`` in place."""

def vec_add_scaled(
    out: NDArray[np.float64], x: NDArray[np.float64], alpha: float, y: NDArray[np.float64]
) -> None:
    """``out = x + alpha · y`` (``out`` must be another array than ``x`` and ``y``)."""

def vec_lincomb(
    out: NDArray[np.float64], coeffs: Sequence[float], vectors: Sequence[NDArray[np.float64]]
) -> None:
    """``out = Σ coeffs[i] · vectors[i]``, summed in the order given."""

def vec_abs_sum_max(x: NDArray[np.float64]) -> tuple[float, float]:
    """``(Σ |x_i|, max |x_i|)``; the max is NaN if any element is NaN."""
