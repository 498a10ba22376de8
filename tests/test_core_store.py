"""ParamStore bindings: zero-copy views, versions, shared memory across processes, bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from dniasync._core import LayoutMismatchError, NonFiniteGradientError, ParamStore


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    path = f"/dev/shm/dniasync-{name}"
    if os.path.exists(path):
        os.unlink(path)


def test_view_is_zero_copy_and_sees_every_update() -> None:
    store = ParamStore([("w", 1000), ("b", 10)], "sgd")
    w = store.view("w")
    b = store.view("b")
    assert w.dtype == np.float32 and w.shape == (1000,)
    assert np.shares_memory(w, store.view())
    assert store.view().ctypes.data + 1000 * 4 == b.ctypes.data
    grad = np.arange(1000, dtype=np.float32)
    version = store.step("w", grad, 0.5)
    assert version == 1 == store.version("w")
    np.testing.assert_array_equal(w, -0.5 * grad)
    # torch parameters as views: writes through the store show up in the tensor.
    param = torch.from_numpy(w)
    store.add("w", np.ones(1000, np.float32), alpha=2.0)
    assert param[3].item() == pytest.approx(-1.5 + 2.0)
    assert store.version("w") == 2 and store.version("b") == 0


def test_view_outlives_the_store_handle() -> None:
    store = ParamStore([("w", 64)])
    view = store.view("w")
    store.write("w", np.full(64, 7.0, np.float32))
    del store
    assert float(view.sum()) == 7.0 * 64


def test_read_into_returns_the_version_read_and_state_slots() -> None:
    store = ParamStore([("w", 256)], "adam")
    assert store.state_slots == 2
    out = np.empty(256, np.float32)
    assert store.read_into("w", out) == 0
    grad = np.linspace(-1, 1, 256, dtype=np.float32)
    store.step("w", grad, 0.01)
    store.step("w", grad, 0.01)
    assert store.read_into("w", out) == 2
    np.testing.assert_array_equal(out, store.view("w"))
    first_moment = np.empty(256, np.float32)
    store.read_into("w", first_moment, state=1)
    np.testing.assert_allclose(first_moment, 0.19 * grad, rtol=1e-5)
    assert store.steps("w") == 2


@pytest.mark.parametrize(
    ("name", "make_torch", "kwargs"),
    [
        ("sgd", lambda p: torch.optim.SGD([p], lr=0.05, weight_decay=0.01), {"weight_decay": 0.01}),
        ("momentum", lambda p: torch.optim.SGD([p], lr=0.05, momentum=0.9), {}),
        ("nesterov", lambda p: torch.optim.SGD([p], lr=0.05, momentum=0.9, nesterov=True), {}),
        ("adagrad", lambda p: torch.optim.Adagrad([p], lr=0.05), {}),
        ("adam", lambda p: torch.optim.Adam([p], lr=0.05, weight_decay=0.01), {"weight_decay": 0.01}),
    ],
)
def test_optimizers_match_torch(name: str, make_torch: object, kwargs: dict[str, float]) -> None:
    rng = np.random.default_rng(1)
    init = rng.standard_normal(5000).astype(np.float32)
    store = ParamStore([("w", 5000)], name, **kwargs)  # type: ignore[arg-type]
    store.write("w", init)
    param = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = make_torch(param)  # type: ignore[operator]
    for _ in range(5):
        grad = rng.standard_normal(5000).astype(np.float32)
        store.step("w", grad, 0.05)
        param.grad = torch.from_numpy(grad)
        opt.step()
    np.testing.assert_allclose(store.view("w"), param.detach().numpy(), rtol=2e-5, atol=2e-6)


def test_clip_norm_scales_the_gradient() -> None:
    store = ParamStore([("w", 4)], clip_norm=1.0)
    store.step("w", np.array([3.0, 4.0, 0.0, 0.0], np.float32), 1.0)
    np.testing.assert_allclose(store.view("w"), [-0.6, -0.8, 0.0, 0.0], rtol=1e-5)


def test_threads_on_disjoint_segments_sum_exactly() -> None:
    store = ParamStore([(f"s{i}", 100_000) for i in range(4)])
    ones = np.ones(100_000, np.float32)

    def work(segment: str) -> None:
        for _ in range(20):
            store.add(segment, ones)

    threads = [threading.Thread(target=work, args=(f"s{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert np.all(store.view() == 20.0)


def test_exact_add_from_threads_loses_nothing() -> None:
    store = ParamStore([("w", 50_000)])
    ones = np.ones(50_000, np.float32)

    def work() -> None:
        for _ in range(25):
            store.add_exact("w", ones)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert np.all(store.view("w") == 75.0)
    assert store.version("w") == 75


_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from dniasync._core import ParamStore

    store = ParamStore.attach(sys.argv[1], [("w", 1000), ("b", 3)], "momentum")
    store.step("w", np.ones(1000, np.float32), 0.5)
    print(store.version("w"), flush=True)
    sys.stdin.readline()  # the parent has written "b"
    print(float(store.view("b")[0]), store.version("b"), flush=True)
    """
)


def test_two_processes_share_one_store(shm_name: str) -> None:
    store = ParamStore([("w", 1000), ("b", 3)], "momentum", shm_name=shm_name)
    assert store.is_owner and store.shm_name == shm_name
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, shm_name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    try:
        assert child.stdout.readline().strip() == "1"
        np.testing.assert_array_equal(store.view("w"), np.full(1000, -0.5, np.float32))
        assert store.version("w") == 1
        momentum = np.empty(1000, np.float32)
        store.read_into("w", momentum, state=1)
        assert np.all(momentum == 1.0)
        store.write("b", np.array([4.0, 5.0, 6.0], np.float32))
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["4.0", "1"]
    finally:
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    store.close()
    assert not os.path.exists(f"/dev/shm/dniasync-{shm_name}")
    with pytest.raises(FileNotFoundError):
        ParamStore.attach(shm_name)


def test_attach_with_another_layout_is_refused(shm_name: str) -> None:
    with ParamStore([("w", 10)], "adam", shm_name=shm_name):
        with pytest.raises(LayoutMismatchError, match=r"w\[10\]"):
            ParamStore.attach(shm_name, [("w", 11)])
        with pytest.raises(LayoutMismatchError, match="Adagrad"):
            ParamStore.attach(shm_name, optimizer="adagrad")
        with pytest.raises(FileExistsError):
            ParamStore([("w", 10)], shm_name=shm_name)
        assert ParamStore.attach(shm_name, [("w", 10)], "adam").segments == [("w", 0, 10)]
    assert not os.path.exists(f"/dev/shm/dniasync-{shm_name}")


def test_stale_store_of_a_killed_owner_is_detected_and_removed(shm_name: str) -> None:
    code = (
        "import sys, time\nfrom dniasync._core import ParamStore\n"
        "s = ParamStore([('w', 10)], shm_name=sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code, shm_name], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    assert owner.stdout.readline().strip() == "ready"
    assert not ParamStore.is_stale(shm_name)
    assert not ParamStore.remove_stale(shm_name)
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=30)
    assert ParamStore.is_stale(shm_name)
    survivor = ParamStore.attach(shm_name)  # data outlives its owner until removed
    assert ParamStore.remove_stale(shm_name)
    assert not os.path.exists(f"/dev/shm/dniasync-{shm_name}")
    assert survivor.version("w") == 0


def test_bad_input_raises_the_documented_exception() -> None:
    store = ParamStore([("w", 100)], "adagrad")
    good = np.ones(100, np.float32)
    with pytest.raises(TypeError, match="dtype float32, got float64"):
        store.step("w", np.ones(100), 0.1)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        store.step("w", [1.0] * 100, 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="C-contiguous"):
        store.step("w", np.ones(200, np.float32)[::2], 0.1)
    with pytest.raises(ValueError, match="expected 100 elements, got 99"):
        store.step("w", np.ones(99, np.float32), 0.1)
    with pytest.raises(ValueError, match="expected 100 elements, got 101"):
        store.read_into("w", np.empty(101, np.float32))
    with pytest.raises(KeyError, match="nope"):
        store.step("nope", good, 0.1)
    with pytest.raises(KeyError):
        store.view("nope")
    with pytest.raises(ValueError, match="lr"):
        store.step("w", good, float("nan"))
    with pytest.raises(ValueError, match="state slot 2"):
        store.view("w", state=2)
    with pytest.raises(ValueError, match="unknown optimizer"):
        ParamStore([("w", 1)], "rmsprop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="duplicate segment"):
        ParamStore([("w", 1), ("w", 2)])
    with pytest.raises(ValueError, match="non-finite policy"):
        store.set_nonfinite_policy("ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="read-only|writeable"):
        frozen = np.empty(100, np.float32)
        frozen.flags.writeable = False
        store.read_into("w", frozen)
    assert store.version("w") == 0


def test_nonfinite_gradient_is_rejected_and_counted_unless_allowed() -> None:
    store = ParamStore([("w", 3000)], "adam")
    before = store.view("w").copy()
    for bad in (float("nan"), float("inf"), -float("inf")):
        grad = np.ones(3000, np.float32)
        grad[2999] = bad
        with pytest.raises(NonFiniteGradientError, match="NaN or Inf"):
            store.step("w", grad, 0.1)
    with pytest.raises(NonFiniteGradientError):
        store.add("w", np.full(3000, np.nan, np.float32))
    assert store.rejected_nonfinite == 4
    assert store.version("w") == 0 and store.steps("w") == 0
    np.testing.assert_array_equal(store.view("w"), before)
    store.set_nonfinite_policy("allow")
    assert store.nonfinite_policy == "allow"
    grad = np.ones(3000, np.float32)
    grad[0] = np.nan
    store.step("w", grad, 0.1)
    assert np.isnan(store.view("w")[0]) and store.rejected_nonfinite == 4


@pytest.mark.parametrize("cap", ["base", "avx2"])
def test_capped_instruction_set_gives_identical_results(cap: str) -> None:
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        from dniasync._core import ParamStore, kernel_isa

        store = ParamStore([("w", 4099)], "adam", weight_decay=0.01)
        grad = np.sin(np.arange(4099, dtype=np.float32))
        for _ in range(3):
            store.step("w", grad, 0.01)
        sys.stdout.write(kernel_isa() + " " + store.view("w").tobytes().hex())
        """
    )
    env = dict(os.environ, DNIASYNC_ISA=cap)
    capped = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    isa, hexed = capped.stdout.split()
    assert isa in (cap, "base")  # a CPU without the capped set falls back further
    store = ParamStore([("w", 4099)], "adam", weight_decay=0.01)
    grad = np.sin(np.arange(4099, dtype=np.float32))
    for _ in range(3):
        store.step("w", grad, 0.01)
    assert store.view("w").tobytes().hex() == hexed
