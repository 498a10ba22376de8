"""Checkpoints: exact round trips, a writer killed mid-checkpoint, flipped bytes, config mismatches, K kept."""

from __future__ import annotations

import json
import logging
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from dniasync.train.checkpoint import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    CheckpointState,
    CheckpointStore,
    Part,
    PartRecord,
    config_hash,
)
from dniasync.train.checkpoint._format import seal

CONFIG = {"model": {"kind": "mlp", "hidden": [64, 32]}, "optimizer": {"lr": 0.01, "kind": "adagrad"}, "seed": 3}


def state(value: float, n: int = 1000) -> CheckpointState:
    """Two PS parts whose every float is ``value``: a loaded checkpoint says which write it came from."""
    return CheckpointState(
        parts={
            "ps-0": Part({"w": np.full(n, value, np.float32)}, {"version": int(value), "incarnation": 1}),
            "ps-1": Part({"w": np.full(n, value, np.float32)}, {"version": int(value), "incarnation": 2}),
        },
        meta={"cursors": [{"shard": 0, "epoch": 1, "position": int(value)}], "history": [[value, 0.5]]},
        wall_time_s=value,
    )


def seqs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def run_writer(root: Path, body: str) -> subprocess.Popen[str]:
    """A separate Python process using the library on ``root``: the process a SIGKILL hits."""
    script = textwrap.dedent(
        f"""
        import sys, time
        import numpy as np
        from pathlib import Path
        from dniasync.train.checkpoint import CheckpointStore, CheckpointState, Part, write_part
        store = CheckpointStore(Path({str(root)!r}), "job", {CONFIG!r}, keep=2)
        """
    ) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def test_empty_or_missing_store_gives_none(tmp_path: Path) -> None:
    assert CheckpointStore(tmp_path / "absent", "job", CONFIG).latest() is None
    assert CheckpointStore(tmp_path, "job", CONFIG).latest() is None


def test_round_trip_is_exact_for_every_dtype_shape_and_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((64, 48)).astype(np.float32)
    tensors = {
        "f32": base,
        "f32_strided": base[::3, ::2],  # a view: must be saved as its values, not its buffer
        "f32_fortran": np.asfortranarray(base),
        "f64": rng.standard_normal(7),
        "i64": rng.integers(-(2**62), 2**62, size=(3, 5), dtype=np.int64),
        "u8": rng.integers(0, 256, size=1000, dtype=np.uint8),
        "scalar": np.array(12345678901, dtype=np.int64),
        "empty": np.zeros((0, 4), np.float32),
        "mask": np.array([True, False, True]),
        "big_endian": np.arange(5, dtype=">f4"),
    }
    meta = {"version": 41, "incarnation": 2, "ledger": {"r0": [1, 9]}, "lr": 0.1, "note": "é"}
    job_meta = {"cursors": [{"shard": 1, "epoch": 0, "position": 7}], "history": [[1.5, float("nan")]]}
    store = CheckpointStore(tmp_path, "job", CONFIG)
    path = store.write(CheckpointState({"stage-0": Part(tensors, meta)}, job_meta, wall_time_s=12.5))
    assert path == tmp_path / "ckpt-00000001"

    loaded = store.latest()
    assert loaded is not None and loaded.path == path and loaded.seq == 1
    assert loaded.parts == ("stage-0",) and loaded.wall_time_s == 12.5
    assert loaded.part_meta("stage-0") == meta
    assert loaded.meta["cursors"] == job_meta["cursors"] and np.isnan(loaded.meta["history"][0][1])
    got = loaded.tensors("stage-0")
    assert set(got) == set(tensors)
    for name, array in tensors.items():
        assert got[name].dtype == array.dtype.newbyteorder("=") and got[name].shape == array.shape, name
        assert np.array_equal(got[name], array), name
    # The files are plain safetensors; the manifest plain JSON naming each file's sha256 and size.
    assert np.array_equal(safetensors.numpy.load_file(path / "stage-0.safetensors")["i64"], tensors["i64"])
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["job"] == "job" and manifest["config_hash"] == config_hash(CONFIG)
    assert manifest["parts"]["stage-0"]["size"] == (path / "stage-0.safetensors").stat().st_size
    assert manifest["parts"]["stage-0"]["tensors"]["f32_strided"] == {"dtype": "float32", "shape": [22, 24]}
    with pytest.raises(KeyError, match="has no part 'ps-0'; it has \\['stage-0'\\]"):
        loaded.tensors("ps-0")


def test_writer_killed_between_two_files_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "job", CONFIG, keep=2)
    store.write(state(1.0))
    writer = run_writer(
        tmp_path,
        """
        pending = store.begin()
        pending.write_part("ps-0", {"w": np.full(1000, 2.0, np.float32)})
        print("between", pending.path, flush=True)
        time.sleep(60)
        pending.write_part("ps-1", {"w": np.full(1000, 2.0, np.float32)})
        pending.commit({})
        """,
    )
    assert writer.stdout is not None
    line = writer.stdout.readline().split()
    writer.send_signal(signal.SIGKILL)
    assert writer.wait(timeout=10) == -signal.SIGKILL
    assert line[0] == "between"
    left = Path(line[1])
    assert left.parent == tmp_path and left.name.startswith(".tmp-")
    assert sorted(p.name for p in left.iterdir()) == ["ps-0.safetensors"]

    loaded = store.latest()
    assert loaded is not None and loaded.seq == 1
    assert np.all(loaded.tensors("ps-1")["w"] == 1.0) and loaded.meta["history"] == [[1.0, 0.5]]
    assert left.exists(), "reading never changes the store"

    # The next checkpoint takes a number past the abandoned one and clears it away.
    assert store.write(state(3.0)).name == "ckpt-00000003"
    assert seqs(tmp_path) == ["ckpt-00000001", "ckpt-00000003"]
    loaded = store.latest()
    assert loaded is not None and loaded.seq == 3 and np.all(loaded.tensors("ps-0")["w"] == 3.0)


def test_writer_killed_at_random_moments_always_leaves_a_verifying_checkpoint(tmp_path: Path) -> None:
    rnd = random.Random(18)
    committed, interrupted = 0, 0
    for round_ in range(6):
        writer = run_writer(
            tmp_path,
            """
            for i in range(1, 10_000):
                path = store.write(CheckpointState(
                    {f"ps-{p}": Part({"w": np.full(300_000, float(i), np.float32)}, {"version": i}) for p in range(3)},
                    {"i": i},
                ))
                print("committed", path.name, flush=True)
            """,
        )
        assert writer.stdout is not None
        writer.stdout.readline()  # one commit per round at least, then a kill at any moment
        time.sleep(rnd.uniform(0.0, 0.4))
        writer.send_signal(signal.SIGKILL)
        out, _ = writer.communicate(timeout=10)
        names = [line.split()[1] for line in out.splitlines() if line.startswith("committed")]
        if names:
            committed = int(names[-1].removeprefix("ckpt-"))
        interrupted += any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())

        loaded = CheckpointStore(tmp_path, "job", CONFIG, keep=2).latest()
        assert loaded is not None, f"round {round_}"
        assert loaded.seq >= committed
        for part in ("ps-0", "ps-1", "ps-2"):  # every part from the same write
            assert loaded.part_meta(part)["version"] == loaded.meta["i"]
            assert np.all(loaded.tensors(part)["w"] == float(loaded.meta["i"]))
    assert interrupted >= 1, "no kill landed inside a write: the test proved nothing"
    assert len([n for n in seqs(tmp_path) if n.startswith("ckpt-")]) <= 3  # keep=2, plus one if killed before pruning


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_in_a_tensor_file_is_named_and_the_previous_checkpoint_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, "job", CONFIG)
    store.write(state(1.0))
    second = store.write(state(2.0))
    bad = second / "ps-1.safetensors"
    flip_byte(bad, bad.stat().st_size - 100)  # inside the tensor data, not the header

    with caplog.at_level(logging.WARNING, logger="dniasync.train.checkpoint"):
        loaded = store.latest()
    assert loaded is not None and loaded.seq == 1 and np.all(loaded.tensors("ps-1")["w"] == 1.0)
    assert "ckpt-00000002 skipped" in caplog.text and str(bad) in caplog.text and "sha256" in caplog.text
    with pytest.raises(CheckpointCorrupt, match="ps-1.safetensors: sha256") as info:
        store.load(second)
    assert info.value.path == bad


@pytest.mark.parametrize(
    ("damage", "named", "reason"),
    [
        ("truncate", "ps-0.safetensors", "size 4000 bytes, manifest says"),
        ("delete", "ps-0.safetensors", "missing"),
        ("manifest_digit", "manifest.json", "manifest_sha256 does not match"),
        ("manifest_torn", "manifest.json", "unreadable"),
    ],
)
def test_other_damage_is_named_and_skipped(tmp_path: Path, damage: str, named: str, reason: str) -> None:
    store = CheckpointStore(tmp_path, "job", CONFIG)
    store.write(state(1.0))
    second = store.write(state(2.0))
    if damage == "truncate":
        with open(second / "ps-0.safetensors", "r+b") as f:
            f.truncate(4000)
    elif damage == "delete":
        (second / "ps-0.safetensors").unlink()
    elif damage == "manifest_digit":
        text = (second / "manifest.json").read_text()
        assert '"version": 2' in text
        (second / "manifest.json").write_text(text.replace('"version": 2', '"version": 3', 1))
    else:
        text = (second / "manifest.json").read_bytes()
        (second / "manifest.json").write_bytes(text[: len(text) // 2])
    with pytest.raises(CheckpointCorrupt, match=reason) as info:
        store.load(second)
    assert info.value.path == second / named
    loaded = store.latest()
    assert loaded is not None and loaded.seq == 1


def test_no_verifying_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "job", CONFIG)
    path = store.write(state(1.0))
    flip_byte(path / "ps-0.safetensors", 200)
    with pytest.raises(CheckpointError, match="no checkpoint verifies: .*ps-0.safetensors"):
        store.latest()


def test_resuming_with_another_config_fails_naming_each_difference(tmp_path: Path) -> None:
    CheckpointStore(tmp_path, "job", CONFIG).write(state(1.0))
    changed = {**CONFIG, "optimizer": {"lr": 0.02, "kind": "adagrad"}, "extra": True}
    del changed["seed"]
    with pytest.raises(CheckpointMismatch) as info:
        CheckpointStore(tmp_path, "job", changed).latest()
    message = str(info.value)
    assert "ckpt-00000001 was written with a different config" in message
    assert "optimizer.lr: 0.01 in the checkpoint, 0.02 now" in message
    assert "extra: absent in the checkpoint, true now" in message
    assert "seed: 3 in the checkpoint, absent now" in message
    assert "model" not in message
    # Key order and tuples-vs-lists are not differences.
    same = {"seed": 3, "optimizer": {"kind": "adagrad", "lr": 0.01}, "model": {"hidden": (64, 32), "kind": "mlp"}}
    assert config_hash(same) == config_hash(CONFIG)
    assert CheckpointStore(tmp_path, "job", same).latest() is not None
    with pytest.raises(CheckpointMismatch, match="belongs to job 'job', not 'other'"):
        CheckpointStore(tmp_path, "other", CONFIG).latest()


def test_a_manifest_from_a_newer_format_is_refused_clearly(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "job", CONFIG)
    path = store.write(state(1.0))
    doc = json.loads((path / "manifest.json").read_text())
    del doc["manifest_sha256"]
    doc["format_version"] = 2
    (path / "manifest.json").write_bytes(seal(doc))  # intact, just newer
    with pytest.raises(CheckpointMismatch, match="format version 2 is newer than this dniasync reads \\(1\\)"):
        store.latest()


def test_the_last_k_intact_checkpoints_are_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "job", CONFIG, keep=3)
    for value in range(1, 6):
        store.write(state(float(value)))
    assert seqs(tmp_path) == ["ckpt-00000003", "ckpt-00000004", "ckpt-00000005"]

    # A damaged checkpoint does not count towards K: the older good one survives until K newer are intact.
    store = CheckpointStore(tmp_path, "job", CONFIG, keep=2)
    with open(tmp_path / "ckpt-00000005" / "ps-0.safetensors", "r+b") as f:
        f.truncate(10)
    store.write(state(6.0))
    assert seqs(tmp_path) == ["ckpt-00000004", "ckpt-00000005", "ckpt-00000006"]
    store.write(state(7.0))
    assert seqs(tmp_path) == ["ckpt-00000006", "ckpt-00000007"]


def test_parts_written_by_other_processes_join_one_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "job", CONFIG)
    pending = store.begin()
    writer = run_writer(
        tmp_path,
        f"""
        import json
        record = write_part(Path({str(pending.path)!r}), "ps-1", {{"w": np.arange(10, dtype=np.float32)}},
                            {{"version": 7, "incarnation": 3}})
        print(json.dumps(record.to_dict()))
        """,
    )
    out, _ = writer.communicate(timeout=60)
    assert writer.returncode == 0
    remote = PartRecord.from_dict("ps-1", json.loads(out))
    pending.write_part("ps-0", {"w": np.ones(4, np.float32)}, {"version": 5, "incarnation": 1})
    (pending.path / ".ps-2.0123.partial").write_bytes(b"a part writer killed mid-file")
    path = pending.commit({"cursors": []}, wall_time_s=3.0, records=[remote])
    assert seqs(path) == ["manifest.json", "ps-0.safetensors", "ps-1.safetensors"]

    loaded = store.latest()
    assert loaded is not None and loaded.path == path and loaded.parts == ("ps-0", "ps-1")
    assert loaded.part_meta("ps-1") == {"version": 7, "incarnation": 3}
    assert np.array_equal(loaded.tensors("ps-1")["w"], np.arange(10, dtype=np.float32))

    # A record whose file never arrived cannot be committed.
    pending = store.begin()
    with pytest.raises(CheckpointError, match="ps-1.safetensors: missing, record says"):
        pending.commit({}, records=[remote])


def test_bad_inputs_are_refused_before_anything_is_renamed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, "job", CONFIG)
    with pytest.raises(CheckpointError, match="meta of part 'ps-0' is not plain JSON data"):
        store.write(CheckpointState({"ps-0": Part({"w": np.ones(2)}, {"version": np.int64(3)})}))
    with pytest.raises(CheckpointError, match="part name '../x'"):
        store.write(CheckpointState({"../x": Part({"w": np.ones(2)})}))
    with pytest.raises(CheckpointError, match="tensor ps-0/w is a list, not a numpy array"):
        store.write(CheckpointState({"ps-0": Part({"w": [1.0]})}))  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="job meta is not plain JSON data"):
        store.write(CheckpointState({"ps-0": Part({"w": np.ones(2)})}, {"when": object()}))
    with pytest.raises(CheckpointError, match="config is not plain JSON data"):
        CheckpointStore(tmp_path, "job", {"root": Path("/x")})
    assert seqs(tmp_path) == []
