"""Rust core: optimizer steps, Hogwild threads and gradient encoders vs torch and numpy,
under every instruction set the kernels have for this CPU.

Run: python benchmarks/bench_core.py [--quick]

All on 10M float32 (1M with --quick), one thread each side (torch.set_num_threads(1),
our kernels are single-threaded), side by side in one run; times are medians.

- instruction sets: every kernel runs under each set `_core.kernel_isas()` lists (the
  portable "base", "avx2", "avx512": whichever this CPU has, within DNIASYNC_ISA), capped
  in this process with `_core.set_kernel_isa`, the sets taking turns with the reference
  in one interleaved loop. Unsuffixed figures are the widest set's; `<figure>_<isa>` are
  each set's (so `sgd_vs_torch_avx2` is SGD capped to AVX2 on a CPU that has more).
- optimizer steps: ParamStore.step vs torch.optim.* (foreach=True, and fused=True: torch's
  single-kernel CPU update, its fastest) on the same data.
  Our NaN/Inf check costs one extra read of the gradient; torch does none, so the ratio
  compares equal work (policy "allow") and the checked time is reported beside it.
- hogwild: two Python threads stepping one store at once (GIL released) vs one thread;
  thread scaling (here and for the copy) is best-of-rounds, not median (see bench_hogwild).
- encoders: threshold (1% of elements cross tau), 1-bit (with error feedback) and 8-bit
  vs the same math vectorised in numpy (outputs checked equal first). The threshold
  reference is the careful numpy version (gather only the crossing indices); the obvious
  version with boolean masks is timed too, for context. Our encoders check the gradient
  for NaN/Inf (the threshold and 1-bit ones in a pass of their own, as the state they
  carry must not change for a rejected gradient); numpy's do not.
- floor: a plain numpy copy gives the memory bandwidth (STREAM convention: bytes read +
  bytes written); each kernel's bytes moved per second (bytes read + bytes written, in
  place or not) are reported as a fraction of it, the copy being timed in the same
  interleaved loop as the kernel (so a busy spell on this shared machine slows both). In-place kernels can pass 1.0: a copy
  also pays for reading in the destination's lines before writing them, which an in-place
  update never does. The copy is timed on two threads as well: that ratio is the ceiling
  for any memory-bound kernel's thread scaling.
Ratios (bigger is better): <step>_vs_torch (foreach), <step>_vs_torch_fused, hogwild_2threads_vs_1, <codec>_encode_vs_numpy,
threshold_encode_gelem_per_s, <kernel>_bandwidth_fraction; each also per instruction set.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import _common
import numpy as np
import torch

from dniasync._core import (
    Int8Codec,
    OneBitCodec,
    ParamStore,
    ThresholdCodec,
    kernel_isas,
    set_kernel_isa,
)

# Bytes each optimizer step moves per element: reads of w, g and state, writes of w and state.
STEP_BYTES = {"sgd": 12, "momentum": 20, "nesterov": 20, "adagrad": 20, "adam": 28}
BLOCK = 320  # 1-bit and 8-bit block: divides both 10M and 1M, a multiple of 8
# Bytes each encode moves per element: threshold and 1-bit read the gradient and read and
# write the carried residual/error, plus the payload they write (a bit; a byte and a scale).
ENCODE_BYTES = {"threshold": 12.0, "onebit": 12 + 1 / 8 + 8 / BLOCK, "int8": 5 + 4 / BLOCK}


Case = tuple[Callable[[], object], Callable[[], object] | None]  # (timed call, untimed setup)


def interleaved(cases: list[Case], repeats: int) -> list[float]:
    """Median seconds of each case, the cases taking turns so drift on a shared machine hits all alike."""
    times: list[list[float]] = [[] for _ in cases]
    for rep in range(repeats + 1):
        for k, (fn, setup) in enumerate(cases):
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            if rep:  # the first round warms up
                times[k].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def median_time(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> float:
    return interleaved([(fn, setup)], repeats)[0]


def capped(isa: str, then: Callable[[], object] | None = None) -> Callable[[], None]:
    """Setup that caps the kernels at `isa` (and runs `then`)."""

    def setup() -> None:
        set_kernel_isa(isa)  # type: ignore[arg-type]
        if then is not None:
            then()

    return setup


def torch_optimizer(name: str, param: torch.Tensor, fused: bool = False) -> torch.optim.Optimizer:
    """torch's ``name`` over ``param``: its foreach implementation, or its fused CPU kernel."""
    foreach, fuse = (None, True) if fused else (True, None)
    if name == "sgd":
        return torch.optim.SGD([param], lr=1e-3, foreach=foreach, fused=fuse)
    if name in ("momentum", "nesterov"):
        return torch.optim.SGD([param], lr=1e-3, momentum=0.9, nesterov=name == "nesterov", foreach=foreach,
                               fused=fuse)
    if name == "adagrad":
        return torch.optim.Adagrad([param], lr=1e-3, foreach=foreach, fused=fuse)
    return torch.optim.Adam([param], lr=1e-3, foreach=foreach, fused=fuse)


def bench_optimizers(
    n: int, repeats: int, grad: np.ndarray, isas: list[str], copy: Case
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in STEP_BYTES:
        stores = {isa: ParamStore([("w", n)], name, nonfinite="allow") for isa in isas}  # type: ignore[arg-type]
        checked_store = ParamStore([("w", n)], name)  # type: ignore[arg-type]
        param = torch.zeros(n)
        # torch's own copy, restored before each step: its Nesterov step adds into the gradient.
        pristine = torch.from_numpy(grad.copy())
        param.grad = torch_grad = pristine.clone()
        opt = torch_optimizer(name, param)
        fused_param = torch.zeros(n)
        fused_param.grad = fused_grad = pristine.clone()
        fused_opt = torch_optimizer(name, fused_param, fused=True)
        cases: list[Case] = [
            copy,
            (opt.step, partial(torch_grad.copy_, pristine)),
            (fused_opt.step, partial(fused_grad.copy_, pristine)),
            (partial(checked_store.step, "w", grad, 1e-3), capped(isas[-1])),
        ]
        cases += [(partial(stores[isa].step, "w", grad, 1e-3), capped(isa)) for isa in isas]
        copy_s, torch_s, fused_s, checked, *ours = interleaved(cases, repeats)
        out[name] = {"copy_s": copy_s, "torch_s": torch_s, "torch_fused_s": fused_s, "dniasync_checked_s": checked,
                     "dniasync_s": ours[-1]}
        out[name] |= {f"dniasync_{isa}_s": t for isa, t in zip(isas, ours, strict=True)}
        del stores, checked_store, opt, param, torch_grad, fused_opt, fused_param, fused_grad
    set_kernel_isa(None)
    return out


def bench_hogwild(n: int, updates: int, grad: np.ndarray) -> dict[str, float]:
    store = ParamStore([("w", n)], "sgd", nonfinite="allow")

    def run(threads: int) -> float:
        barrier = threading.Barrier(threads + 1)

        def worker() -> None:
            barrier.wait()
            for _ in range(updates):
                store.step("w", grad, 1e-6)

        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for t in pool:
            t.start()
        barrier.wait()
        start = time.perf_counter()
        for t in pool:
            t.join()
        return threads * updates / (time.perf_counter() - start)

    run(1)
    # Best of interleaved rounds: another process on this shared box slows a run that needs
    # both cores more than one that needs a single core, which a median would count against us.
    rounds = [(run(1), run(2)) for _ in range(9)]
    one = max(r[0] for r in rounds)
    two = max(r[1] for r in rounds)
    return {"one_thread_updates_per_s": one, "two_threads_updates_per_s": two}


def numpy_threshold(r: np.ndarray, g: np.ndarray, tau: float) -> np.ndarray:
    np.add(r, g, out=r)
    idx = np.flatnonzero(np.abs(r) >= tau)
    vals = r[idx]
    neg = vals < 0
    r[idx] = vals - np.where(neg, -tau, tau).astype(np.float32)
    return idx.astype(np.uint32) | (neg.astype(np.uint32) << np.uint32(31))


def numpy_threshold_masks(r: np.ndarray, g: np.ndarray, tau: float) -> np.ndarray:
    """The same math written the obvious way, with boolean masks (for context only)."""
    r += g
    pos, neg = r >= tau, r <= -tau
    idx = np.flatnonzero(pos | neg).astype(np.uint32)
    codes = idx | (neg[idx].astype(np.uint32) << np.uint32(31))
    r[pos] -= tau
    r[neg] += tau
    return codes


def numpy_onebit(err: np.ndarray, g: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    np.add(err, g, out=err)
    acc = err.reshape(-1, block)
    nonneg = acc >= 0
    count = nonneg.sum(axis=1)
    pos_sum = np.where(nonneg, acc, 0).sum(axis=1)
    total = acc.sum(axis=1)
    pos = (pos_sum / np.maximum(count, 1)).astype(np.float32)
    neg = ((total - pos_sum) / np.maximum(block - count, 1)).astype(np.float32)
    acc -= np.where(nonneg, pos[:, None], neg[:, None])
    return np.stack([pos, neg], axis=1), np.packbits(nonneg.reshape(-1), bitorder="little")


def numpy_int8(g: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Scales and codes; rounds half away from zero, as the Rust codec (np.round rounds to even)."""
    blocks = g.reshape(-1, block)
    m = np.abs(blocks).max(axis=1)
    scale = m / np.float32(127)
    inv = np.divide(np.float32(127), m, out=np.zeros_like(m), where=m > 0)
    y = blocks * inv[:, None]
    codes = np.trunc(y + np.copysign(np.float32(0.49999997), y)).astype(np.int8)
    return scale, codes


def bench_encoders(
    n: int, repeats: int, grad: np.ndarray, isas: list[str], copy: Case
) -> dict[str, dict[str, float]]:
    def ours(codecs: dict[str, Any], reset: bool) -> list[Case]:
        return [
            (partial(codecs[isa].encode, grad), capped(isa, codecs[isa].reset if reset else None))
            for isa in isas
        ]

    def timed(reference: Case, ours: list[Case]) -> dict[str, float]:
        copy_s, ref_s, *t = interleaved([copy, reference, *ours], repeats)
        return {"copy_s": copy_s, "numpy_s": ref_s, "dniasync_s": t[-1]} | {
            f"dniasync_{isa}_s": s for isa, s in zip(isas, t, strict=True)
        }

    tau = 2.576  # P(|N(0,1)| >= tau) = 1%: each encode from a fresh residual sends 1%
    threshold = {isa: ThresholdCodec(n, tau) for isa in isas}
    r = np.zeros(n, np.float32)
    np_codes = numpy_threshold(r, grad, tau)
    for isa in isas:  # same output as ours, so both sides do the same work
        set_kernel_isa(isa)  # type: ignore[arg-type]
        assert np.array_equal(threshold[isa].encode(grad), np_codes), f"numpy threshold disagrees ({isa})"
    r_np = np.zeros(n, np.float32)
    thr = timed((lambda: numpy_threshold(r_np, grad, tau), lambda: r_np.fill(0)), ours(threshold, True))
    assert np.array_equal(numpy_threshold_masks(np.zeros(n, np.float32), grad, tau), np_codes)
    thr["numpy_boolean_masks_s"] = median_time(lambda: numpy_threshold_masks(r_np, grad, tau), 5, lambda: r_np.fill(0))
    thr["density"] = len(np_codes) / n

    onebit = {isa: OneBitCodec(n, BLOCK) for isa in isas}
    recon, bits = numpy_onebit(np.zeros(n, np.float32), grad, BLOCK)
    for isa in isas:
        set_kernel_isa(isa)  # type: ignore[arg-type]
        payload = onebit[isa].encode(grad)
        # numpy sums in another order, so the means may differ in the last bits.
        assert np.allclose(payload[: recon.nbytes].view(np.float32), recon.reshape(-1), rtol=1e-5), isa
        assert np.array_equal(payload[recon.nbytes :], bits), f"numpy 1-bit disagrees on the bits ({isa})"
    e_np = np.zeros(n, np.float32)
    one = timed((lambda: numpy_onebit(e_np, grad, BLOCK), lambda: e_np.fill(0)), ours(onebit, True))

    int8 = {isa: Int8Codec(n, BLOCK) for isa in isas}
    scale, codes = numpy_int8(grad, BLOCK)
    for isa in isas:
        set_kernel_isa(isa)  # type: ignore[arg-type]
        payload = int8[isa].encode(grad)
        assert np.array_equal(payload[: scale.nbytes].view(np.float32), scale), f"numpy 8-bit scales ({isa})"
        assert np.array_equal(payload[scale.nbytes :].view(np.int8), codes.reshape(-1)), f"numpy 8-bit ({isa})"
    i8 = timed((lambda: numpy_int8(grad, BLOCK), None), ours(int8, False))
    set_kernel_isa(None)
    return {"threshold_encode": thr, "onebit_encode": one, "int8_encode": i8}


def bench_copy(n: int, repeats: int) -> dict[str, float]:
    """Plain-copy bandwidth (STREAM convention: bytes read + bytes written), one and two threads."""
    rng = np.random.default_rng(1)
    src = [rng.random(n, dtype=np.float32) for _ in range(2)]
    dst = [np.empty_like(s) for s in src]

    def two_threads() -> None:
        helper = threading.Thread(target=np.copyto, args=(dst[1], src[1]))
        helper.start()
        np.copyto(dst[0], src[0])
        helper.join()

    def one_thread() -> None:
        np.copyto(dst[0], src[0])

    rounds = [interleaved([(one_thread, None), (two_threads, None)], 1) for _ in range(repeats)]
    # Median for the floor, best-of for the thread scaling (as for Hogwild, see bench_hogwild).
    return {
        "one_thread_bytes_per_s": 8 * n / statistics.median(r[0] for r in rounds),
        "one_thread_best_bytes_per_s": 8 * n / min(r[0] for r in rounds),
        "two_threads_best_bytes_per_s": 2 * 8 * n / min(r[1] for r in rounds),
    }


def cpu_model() -> str:
    """Model name, with family/model/stepping (a VM may show only "AMD EPYC")."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return "unknown"
    flags = set(fields.get("flags", "").split())
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512vl") if f in flags]
    return (
        f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')}, "
        f"model {fields.get('model', '?')}, stepping {fields.get('stepping', '?')}; {' '.join(simd)})"
    )


def plot(results: dict[str, Any], isas: list[str], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fractions = results["bandwidth_fraction"]
    names = list(fractions[isas[-1]])
    height = 0.8 / len(isas)
    fig, ax = plt.subplots(figsize=(7.5, 0.22 * len(names) * len(isas) + 1.2))
    for k, isa in enumerate(isas):
        ys = [i + (k - (len(isas) - 1) / 2) * height for i in range(len(names))]
        ax.barh(ys, [fractions[isa][name] for name in names], height=height, label=isa)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(0.85, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("bytes moved per second / plain copy bandwidth (dashed: 0.85)")
    ax.set_title(f"dniasync core kernels per instruction set, {results['n']:,} floats, one thread", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = _common.parser(__doc__ or "").parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    n = 1_000_000 if args.quick else 10_000_000
    repeats = 5 if args.quick else 21
    grad = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    grad.flags.writeable = False  # every side reads the same gradient, and none may change it
    isas: list[str] = list(kernel_isas())
    best = isas[-1]

    copy = bench_copy(n, repeats)
    copy_bw = copy["one_thread_bytes_per_s"]
    # Each group of cases below times this copy too: its fractions use the copy of its own turns.
    src, dst = np.random.default_rng(2).random(n, dtype=np.float32), np.empty(n, np.float32)
    copy_case: Case = (lambda: np.copyto(dst, src), None)
    optim = bench_optimizers(n, repeats, grad, isas, copy_case)
    hog = bench_hogwild(n, 10 if args.quick else 40, grad)
    enc = bench_encoders(n, repeats, grad, isas, copy_case)

    def seconds(r: dict[str, float], isa: str) -> float:
        return r[f"dniasync_{isa}_s"]

    def of_copy(bytes_per_elem: float, r: dict[str, float], isa: str) -> float:
        return bytes_per_elem * n / seconds(r, isa) / (8 * n / r["copy_s"])

    fraction = {
        isa: {f"{k}_step": of_copy(STEP_BYTES[k], optim[k], isa) for k in STEP_BYTES}
        | {f"{c}_encode": of_copy(ENCODE_BYTES[c], enc[f"{c}_encode"], isa) for c in ENCODE_BYTES}
        for isa in isas
    }

    def figures(isa: str) -> dict[str, float]:
        f = {f"{k}_vs_torch": optim[k]["torch_s"] / seconds(optim[k], isa) for k in STEP_BYTES}
        f |= {f"{k}_vs_torch_fused": optim[k]["torch_fused_s"] / seconds(optim[k], isa) for k in STEP_BYTES}
        f |= {f"{c}_encode_vs_numpy": enc[f"{c}_encode"]["numpy_s"] / seconds(enc[f"{c}_encode"], isa)
              for c in ENCODE_BYTES}
        f["threshold_encode_gelem_per_s"] = n / seconds(enc["threshold_encode"], isa) / 1e9
        f |= {f"{kernel}_bandwidth_fraction": v for kernel, v in fraction[isa].items()}
        return f

    load_after = os.getloadavg()
    results: dict[str, Any] = {
        "n": n,
        "cpu": cpu_model(),
        "numpy": np.__version__,
        "kernel_isa": best,
        "kernel_isas": isas,
        "load_average_1min_before_after": [load_before[0], load_after[0]],
        "copy_bandwidth_gb_per_s": copy_bw / 1e9,
        "copy_two_threads_best_gb_per_s": copy["two_threads_best_bytes_per_s"] / 1e9,
        **{f"{k}_10M" if not args.quick else f"{k}_1M": v for k, v in optim.items()},
        "hogwild_sgd": hog,
        **enc,
        "bandwidth_fraction": fraction,
    }
    ratios = figures(best)
    ratios["hogwild_2threads_vs_1"] = hog["two_threads_updates_per_s"] / hog["one_thread_updates_per_s"]
    # The ceiling for any memory-bound kernel's thread scaling on this machine.
    ratios["copy_2threads_vs_1"] = copy["two_threads_best_bytes_per_s"] / copy["one_thread_best_bytes_per_s"]
    for isa in isas:
        ratios |= {f"{k}_{isa}": v for k, v in figures(isa).items()}

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f} ms"

    rows: list[tuple[str, str, str]] = [
        ("plain copy (numpy), 1 thread", f"{copy_bw / 1e9:.1f} GB/s", "floor"),
        ("plain copy (numpy), 2 threads, best", f"{copy['two_threads_best_bytes_per_s'] / 1e9:.1f} GB/s",
         f"{ratios['copy_2threads_vs_1']:.2f}x one thread"),
    ]
    for k in STEP_BYTES:
        r = optim[k]
        rows.append((f"{k}: torch foreach", ms(r["torch_s"]), "1.00 (reference)"))
        rows.append((f"{k}: torch fused", ms(r["torch_fused_s"]), f"{r['torch_s'] / r['torch_fused_s']:.2f}x foreach"))
        for isa in isas:
            rows.append((f"{k}: dniasync {isa}", ms(seconds(r, isa)),
                         f"{ratios[f'{k}_vs_torch_{isa}']:.2f}x torch, {fraction[isa][f'{k}_step']:.0%} of copy bw"))
        rows.append((f"{k}: dniasync {best} + NaN check", ms(r["dniasync_checked_s"]),
                     f"{r['torch_s'] / r['dniasync_checked_s']:.2f}x torch"))
    rows.append(("hogwild sgd: 1 thread, best", f"{hog['one_thread_updates_per_s']:.1f} upd/s", "1.00 (reference)"))
    rows.append(("hogwild sgd: 2 threads, best", f"{hog['two_threads_updates_per_s']:.1f} upd/s",
                 f"{ratios['hogwild_2threads_vs_1']:.2f}x one thread"))
    t = enc["threshold_encode"]
    rows.append(("threshold encode: numpy, boolean masks", ms(t["numpy_boolean_masks_s"]),
                 f"(context: {t['numpy_boolean_masks_s'] / t['dniasync_s']:.0f}x slower than dniasync)"))
    for c, label in (("threshold", "threshold encode"), ("onebit", "1-bit encode"), ("int8", "8-bit encode")):
        r = enc[f"{c}_encode"]
        rows.append((f"{label}: numpy" + (", flatnonzero" if c == "threshold" else ""), ms(r["numpy_s"]),
                     "1.00 (reference)"))
        for isa in isas:
            rate = f"{ratios[f'threshold_encode_gelem_per_s_{isa}']:.2f} Gelem/s, " if c == "threshold" else ""
            rows.append((f"{label}: dniasync {isa}", ms(seconds(r, isa)),
                         f"{ratios[f'{c}_encode_vs_numpy_{isa}']:.1f}x numpy, {rate}"
                         f"{fraction[isa][f'{c}_encode']:.0%} of copy bw"))
    print(f"{n:,} float32, one thread per side, median of {repeats}, kernels: {', '.join(isas)}")
    print(f"cpu: {results['cpu']}; load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(_common.table(rows, ("system", "time / rate", "ratio")))
    path = _common.write("bench_core", args.quick, results, ratios)
    if not args.quick:
        plot(results, isas, str(path.with_suffix(".png")))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
