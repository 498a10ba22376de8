"""Sandblaster's L-BFGS (Dean et al. 2012): vector commands on the shards, scalars on the coordinator.

Each PS shard owns a slice of every vector L-BFGS needs: the parameters ``x``,
the gradient ``g``, the direction ``d``, a trial point ``xt`` with its gradient
``gt``, and its slice of the history pairs ``(s_k, y_k)``
(:class:`ShardVectors`, whose arithmetic runs in the Rust core).
:class:`VectorFreeLBFGS` drives the iterations with scalars only, as in the
"vector-free" two-loop recursion (Chen et al. 2014): the direction is a linear
combination of the basis ``{s_k, y_k, g}``, so the coordinator keeps the dot
products of that basis (a few new ones per iteration, O(history) scalars
per shard) and runs the two-loop recursion on coefficients; shards turn the
coefficients into ``d``.

:func:`reference_lbfgs` is the classic single-process L-BFGS with the same
rules (history size, step rule, curvature check, tolerances) on whole vectors;
with ``line_search = "none"`` they are those of ``torch.optim.LBFGS``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from .. import _core

__all__ = [
    "CURVATURE_EPS",
    "LBFGSResult",
    "LBFGSSettings",
    "LocalGroup",
    "ShardGroup",
    "ShardVectors",
    "VectorFreeLBFGS",
    "reference_lbfgs",
]

CURVATURE_EPS = 1e-10
"""A pair with ``s · y`` at or below this is not stored (torch's rule)."""

F64 = np.float64
Vec = np.ndarray


@dataclass(frozen=True)
class LBFGSSettings:
    """The rules both the reference and the vector-free driver follow."""

    history: int = 10
    max_iterations: int = 20
    lr: float = 1.0
    line_search: Literal["backtracking", "none"] = "backtracking"
    """``none``: a fixed step ``lr`` (the first one ``min(1, 1/|g|_1)·lr``, as torch does);
    ``backtracking``: from that step, halve until the Armijo condition holds."""
    armijo: float = 1e-4
    max_line_search: int = 20
    tolerance_grad: float = 1e-7
    tolerance_change: float = 1e-9


@dataclass
class LBFGSResult:
    """What one run did, iteration by iteration."""

    losses: list[float] = field(default_factory=list)
    """The loss at the start, then after each iteration."""
    steps: list[float] = field(default_factory=list)
    line_search_evals: list[int] = field(default_factory=list)
    evaluations: int = 0
    iterations: int = 0
    stop: str = ""


def _first_step(settings: LBFGSSettings, n_iter: int, g_abs_sum: float) -> float:
    if n_iter == 1:
        return min(1.0, 1.0 / g_abs_sum) * settings.lr if g_abs_sum > 0 else settings.lr
    return settings.lr


# -- the reference: whole vectors in one process ---------------------------------------------------
def reference_lbfgs(
    objective: Callable[[Vec], tuple[float, Vec]], x0: Vec, settings: LBFGSSettings,
    on_iteration: Callable[[int, Vec], None] | None = None,
) -> tuple[Vec, LBFGSResult]:
    """Classic two-loop L-BFGS over float64 vectors; returns the last iterate and the record."""
    x = np.array(x0, dtype=F64)
    loss, g = objective(x)
    result = LBFGSResult(losses=[loss], evaluations=1)
    if np.abs(g).max() <= settings.tolerance_grad:
        result.stop = "gradient below tolerance"
        return x, result
    s_hist: list[Vec] = []
    y_hist: list[Vec] = []
    rho: list[float] = []
    h_diag = 1.0
    d = -g
    t = 0.0
    g_prev = g
    for n_iter in range(1, settings.max_iterations + 1):
        if n_iter > 1:
            y = g - g_prev
            s = d * t
            ys = float(y @ s)
            if ys > CURVATURE_EPS:
                if len(s_hist) == settings.history:
                    del s_hist[0], y_hist[0], rho[0]
                s_hist.append(s)
                y_hist.append(y)
                rho.append(1.0 / ys)
                h_diag = ys / float(y @ y)
            q = -g
            alpha = [0.0] * len(s_hist)
            for i in range(len(s_hist) - 1, -1, -1):
                alpha[i] = float(s_hist[i] @ q) * rho[i]
                q = q - alpha[i] * y_hist[i]
            r = q * h_diag
            for i in range(len(s_hist)):
                beta = float(y_hist[i] @ r) * rho[i]
                r = r + (alpha[i] - beta) * s_hist[i]
            d = r
        g_prev = g
        t = _first_step(settings, n_iter, float(np.abs(g).sum()))
        gd = float(g @ d)
        if gd > -settings.tolerance_change:
            result.stop = "directional derivative above -tolerance_change"
            break
        prev_loss = loss
        evals = 0
        while True:
            trial_loss, trial_g = objective(x + t * d)
            evals += 1
            if (settings.line_search == "none" or trial_loss <= loss + settings.armijo * t * gd
                    or evals >= settings.max_line_search):
                break
            t *= 0.5
        x = x + t * d
        loss, g = trial_loss, trial_g
        _record(result, loss, t, evals, n_iter)
        if on_iteration is not None:
            on_iteration(n_iter, x)
        reason = _stop_after(settings, n_iter, float(np.abs(g).max()), float(np.abs(d).max()) * abs(t), loss,
                             prev_loss)
        if reason:
            result.stop = reason
            break
    return x, result


def _record(result: LBFGSResult, loss: float, t: float, evals: int, n_iter: int) -> None:
    result.losses.append(loss)
    result.steps.append(t)
    result.line_search_evals.append(evals)
    result.evaluations += evals
    result.iterations = n_iter


def _stop_after(settings: LBFGSSettings, n_iter: int, g_max: float, step_max: float, loss: float,
                prev_loss: float) -> str:
    if n_iter >= settings.max_iterations:
        return "max_iterations"
    if g_max <= settings.tolerance_grad:
        return "gradient below tolerance"
    if step_max <= settings.tolerance_change:
        return "step below tolerance_change"
    if abs(loss - prev_loss) < settings.tolerance_change:
        return "loss change below tolerance_change"
    return ""


# -- the shard side ----------------------------------------------------------------------------------
class ShardVectors:
    """One shard's slice of every L-BFGS vector, and the commands the coordinator sends it."""

    def __init__(self, x0: Vec) -> None:
        self.x = np.array(x0, dtype=F64).reshape(-1)
        n = self.x.size
        self.g = np.zeros(n, F64)
        self.d = np.zeros(n, F64)
        self.xt = self.x.copy()
        self.gt = np.zeros(n, F64)
        self.s: dict[int, Vec] = {}
        self.y: dict[int, Vec] = {}

    @property
    def n(self) -> int:
        return int(self.x.size)

    def vector(self, name: str) -> Vec:
        """``x``, ``g``, ``d``, ``xt``, ``gt``, ``s<k>`` or ``y<k>``."""
        if name[0] in "sy" and name[1:].isdigit():
            return (self.s if name[0] == "s" else self.y)[int(name[1:])]
        vec: Vec = getattr(self, name)
        return vec

    def dots(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        return _core.vec_dots([self.vector(a) for a, _ in pairs], [self.vector(b) for _, b in pairs])

    def trial(self, t: float) -> None:
        """``xt = x + t·d``; the trial gradient starts again from zero."""
        _core.vec_add_scaled(self.xt, self.x, t, self.d)
        self.gt.fill(0.0)

    def set_gradient(self, parts: Sequence[Vec], scale: float) -> None:
        """``gt = scale · Σ parts`` (summed in the order given)."""
        _core.vec_lincomb(self.gt, [scale] * len(parts), [np.ascontiguousarray(p, dtype=F64) for p in parts])

    def accept(self, t: float, k: int | None, pairs: Sequence[tuple[str, str]]) -> tuple[list[float], float, float]:
        """Move to the trial point; with ``k``, store ``s_k = t·d``, ``y_k = gt − g`` first.

        Returns the dot products ``pairs`` (taken after the move) and ``(|g|_1, max |g|)``.
        """
        if k is not None:
            s = self.d.copy()
            _core.vec_scale(t, s)
            y = np.empty_like(self.g)
            _core.vec_add_scaled(y, self.gt, -1.0, self.g)
            self.s[k], self.y[k] = s, y
        self.x, self.xt = self.xt, self.x
        self.g, self.gt = self.gt, self.g
        self.xt[:] = self.x
        g_sum, g_max = _core.vec_abs_sum_max(self.g)
        return self.dots(pairs), g_sum, g_max

    def direction(self, coeffs: Sequence[tuple[str, float]], drop: Sequence[int]) -> tuple[float, float]:
        """Forget the pairs ``drop``; ``d = Σ c·v``; returns ``(g · d, max |d|)``."""
        for k in drop:
            self.s.pop(k, None)
            self.y.pop(k, None)
        _core.vec_lincomb(self.d, [c for _, c in coeffs], [self.vector(name) for name, _ in coeffs])
        _, d_max = _core.vec_abs_sum_max(self.d)
        return _core.vec_dot(self.g, self.d), d_max


# -- the coordinator side -----------------------------------------------------------------------------
class ShardGroup(Protocol):
    """The shards as the coordinator drives them; every reply is summed (or maxed) over shards."""

    async def evaluate(self, t: float) -> float:
        """Every shard moves its trial point to ``x + t·d``; the full-batch loss there (its gradient lands in ``gt``)."""

    async def accept(self, t: float, k: int | None, pairs: list[tuple[str, str]]) -> tuple[list[float], float, float]: ...

    async def direction(self, coeffs: list[tuple[str, float]], drop: list[int]) -> tuple[float, float]: ...


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


class VectorFreeLBFGS:
    """L-BFGS that holds no vector: the two-loop recursion on the dot products of ``{s_k, y_k, g}``."""

    def __init__(self, group: ShardGroup, settings: LBFGSSettings,
                 on_iteration: Callable[[int, LBFGSResult], Awaitable[None]] | None = None,
                 resample: Callable[[int], Awaitable[bool]] | None = None, grad_norm: bool = False) -> None:
        """``resample(n_iter)``, before each iteration after the first: True when the group changed the sample
        its loss is taken on (a batch-size schedule); the loss and gradient at the current point are then taken
        again on the new sample (the stored pairs stay: each was measured on one sample). ``grad_norm``: each
        move also asks for ``g·g`` (one more scalar per shard), read as :attr:`grad_norm2`."""
        self.group = group
        self.settings = settings
        self.on_iteration = on_iteration
        self.resample = resample
        self.grad_norm = grad_norm
        self.result = LBFGSResult()
        self.gram: dict[tuple[str, str], float] = {}
        self.history: list[int] = []
        self.rho: dict[int, float] = {}
        self.h_diag = 1.0

    def _dot(self, a: str, b: str) -> float:
        return self.gram[_key(a, b)]

    @property
    def grad_norm2(self) -> float | None:
        """``‖g‖²`` at the current point (with ``grad_norm``)."""
        return self.gram.get(_key("g", "g"))

    def _accept_pairs(self, k: int | None) -> list[tuple[str, str]]:
        """The dot products the coordinator lacks once the shards moved (and stored pair ``k``)."""
        kept = [*self.history, *([k] if k is not None else [])]
        pairs = [_key("g", f"{v}{j}") for j in kept for v in "sy"] + ([_key("g", "g")] if self.grad_norm else [])
        if k is not None:
            pairs += [_key(f"{a}{k}", f"{b}{j}") for a in "sy" for j in kept for b in "sy"]
        return sorted(set(pairs))

    def _two_loop(self) -> list[tuple[str, float]]:
        """The direction ``−H·g`` as coefficients over the basis (torch's recursion, on scalars)."""
        q: dict[str, float] = {"g": -1.0}
        alpha: dict[int, float] = {}
        for k in reversed(self.history):
            alpha[k] = sum(c * self._dot(f"s{k}", b) for b, c in q.items()) * self.rho[k]
            q[f"y{k}"] = q.get(f"y{k}", 0.0) - alpha[k]
        r = {b: c * self.h_diag for b, c in q.items()}
        for k in self.history:
            beta = sum(c * self._dot(f"y{k}", b) for b, c in r.items()) * self.rho[k]
            r[f"s{k}"] = r.get(f"s{k}", 0.0) + (alpha[k] - beta)
        return sorted(r.items())

    async def _accept(self, t: float, k: int | None) -> tuple[float, float]:
        pairs = self._accept_pairs(k)
        values, g_sum, g_max = await self.group.accept(t, k, pairs)
        self.gram = {key: v for key, v in self.gram.items() if "g" not in key}
        self.gram.update(zip(pairs, values))
        return g_sum, g_max

    async def run(self) -> LBFGSResult:
        st, result = self.settings, self.result
        loss = await self.group.evaluate(0.0)
        g_sum, g_max = await self._accept(0.0, None)
        result.losses.append(loss)
        result.evaluations = 1
        if g_max <= st.tolerance_grad:
            result.stop = "gradient below tolerance"
            return result
        t = 0.0
        pending: int | None = None
        for n_iter in range(1, st.max_iterations + 1):
            drop: list[int] = []
            if pending is not None:
                ys = self._dot(f"s{pending}", f"y{pending}")
                if ys > CURVATURE_EPS:
                    if len(self.history) == st.history:
                        drop.append(self.history.pop(0))
                    self.history.append(pending)
                    self.rho[pending] = 1.0 / ys
                    self.h_diag = ys / self._dot(f"y{pending}", f"y{pending}")
                else:
                    drop.append(pending)
                for k in drop:
                    self.rho.pop(k, None)
                    self.gram = {key: v for key, v in self.gram.items() if f"s{k}" not in key and f"y{k}" not in key}
            if n_iter > 1 and self.resample is not None and await self.resample(n_iter):
                loss = await self.group.evaluate(0.0)
                g_sum, g_max = await self._accept(0.0, None)
                result.evaluations += 1
            coeffs = self._two_loop() if n_iter > 1 else [("g", -1.0)]
            gd, d_max = await self.group.direction(coeffs, drop)
            t = _first_step(st, n_iter, g_sum)
            if gd > -st.tolerance_change:
                result.stop = "directional derivative above -tolerance_change"
                break
            prev_loss = loss
            evals = 0
            while True:
                trial_loss = await self.group.evaluate(t)
                evals += 1
                if (st.line_search == "none" or trial_loss <= loss + st.armijo * t * gd
                        or evals >= st.max_line_search):
                    break
                t *= 0.5
            loss = trial_loss
            pending = n_iter
            g_sum, g_max = await self._accept(t, pending)
            _record(result, loss, t, evals, n_iter)
            if self.on_iteration is not None:
                await self.on_iteration(n_iter, result)
            reason = _stop_after(st, n_iter, g_max, d_max * abs(t), loss, prev_loss)
            if reason:
                result.stop = reason
                break
        return result


class LocalGroup:
    """Shards in this process, with ``objective`` on the whole vector: the vector-free driver without a cluster."""

    def __init__(self, objective: Callable[[Vec], tuple[float, Vec]], x0: Vec, n_shards: int) -> None:
        self.objective = objective
        bounds = np.linspace(0, x0.size, n_shards + 1).astype(int)
        self.shards = [ShardVectors(x0[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def x(self) -> Vec:
        return np.concatenate([s.x for s in self.shards])

    async def evaluate(self, t: float) -> float:
        for shard in self.shards:
            shard.trial(t)
        loss, g = self.objective(np.concatenate([s.xt for s in self.shards]))
        offset = 0
        for shard in self.shards:
            shard.set_gradient([g[offset:offset + shard.n]], 1.0)
            offset += shard.n
        return loss

    async def accept(self, t: float, k: int | None, pairs: list[tuple[str, str]]) -> tuple[list[float], float, float]:
        replies = [s.accept(t, k, pairs) for s in self.shards]
        return combine_accept(replies)

    async def direction(self, coeffs: list[tuple[str, float]], drop: list[int]) -> tuple[float, float]:
        return combine_direction([s.direction(coeffs, drop) for s in self.shards])


def combine_accept(replies: Sequence[tuple[Sequence[float], float, float]]) -> tuple[list[float], float, float]:
    """Shard replies to ``accept``, summed in shard order (max for the max norm)."""
    dots = [math.fsum(values) for values in zip(*(r[0] for r in replies))]
    return dots, sum(r[1] for r in replies), max(r[2] for r in replies)


def combine_direction(replies: Sequence[tuple[float, float]]) -> tuple[float, float]:
    return sum(r[0] for r in replies), max(r[1] for r in replies)
