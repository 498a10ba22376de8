"""bench_data's sparse pushes (#29): Downpour on the fastText example's job, dense against sparse pushes.

The job is ``examples/text_reviews_fasttext.toml`` as shipped (its EmbeddingBag model, 8,192 x 32 rows, and a
Linear layer; 2 replicas, 1 PS shard, Adagrad) on its seeded reviews converted with the WordPiece tokenizer, for a
fixed number of epochs (no target), with ``[downpour] sparse = false`` and ``"auto"`` (only the rows a batch
touched are pushed), at the example's batch of 32 and at 16. Per run: bytes pushed per sample (what went on the
wire: values and spans), samples/s (training time, start-up excluded) and held-out accuracy. Dense and sparse runs
alternate, so a noisy neighbour hits both alike.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import _common

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "text_reviews_fasttext.toml"
BATCHES = (32, 16)
"""The example's batch, then a smaller one: a batch touches fewer of the table's rows."""
SETTINGS = {True: {"epochs": 2, "repeat": 1}, False: {"epochs": 4, "repeat": 3}}
"""By ``--quick``."""


def job(tmp: Path, dataset: Path, name: str, sparse: str, batch: int, epochs: int) -> tuple[Path, Path]:
    """The example's job on ``dataset`` with ``sparse`` pushes, ``batch``, ``epochs`` and no target: (config, out)."""
    out = tmp / name
    text = EXAMPLE.read_text()
    for old, new in (('dataset = "runs/text_reviews/reviews"', f'dataset = "{dataset}"'),
                     ('output_dir = "runs/text_reviews_fasttext"', f'output_dir = "{out}"'),
                     ('sparse = "auto"', f"sparse = {sparse}"), ("batch_size = 32", f"batch_size = {batch}"),
                     ("max_epochs = 6", f"max_epochs = {epochs}"), ("target_accuracy = 0.95\n", "")):
        if old not in text:
            raise RuntimeError(f"{EXAMPLE} no longer has {old!r}: update {__name__}.job")
        text = text.replace(old, new)
    config = tmp / f"{name}.toml"
    config.write_text(text)
    return config, out


def measure(tmp: Path, quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """(results by ``<dense|sparse>_b<batch>`` with the runs, ratios)."""
    from dniasync.train.data.text import generate_reviews

    s = SETTINGS[quick]
    source = generate_reviews(tmp / "reviews.jsonl", 6000, seed=0)
    dataset = tmp / "reviews"
    subprocess.run([sys.executable, "-m", "dniasync.data", "convert", str(source), str(dataset), "--text",
                    "--label-offset", "1", "--max-len", "48", "--quiet"], check=True, capture_output=True, timeout=300)
    runs: dict[str, list[dict[str, Any]]] = {}
    for batch in BATCHES:
        for r in range(s["repeat"]):
            for pushes, sparse in (("dense", "false"), ("sparse", '"auto"')):
                name = f"{pushes}_b{batch}"
                config, out = job(tmp, dataset, f"{name}_{r}", sparse, batch, s["epochs"])
                done = subprocess.run([sys.executable, "-m", "dniasync.node", "--role", "local", "--config",
                                       str(config)], capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    raise RuntimeError(f"{config.name} failed:\n{(done.stdout + done.stderr)[-3000:]}")
                doc = json.loads((out / "summary.json").read_text())
                run = {"samples": doc["samples"], "samples_per_s": doc["samples_per_s"],
                       "bytes_pushed": doc["bytes_pushed"], "dense_bytes_pushed": doc["metrics"]["dense_bytes_pushed"],
                       "bytes_per_sample": doc["bytes_pushed"] / doc["samples"],
                       "final_accuracy": doc["final_accuracy"]}
                runs.setdefault(name, []).append(run)
                _common.say(f"  {name} run {r + 1}: {run['bytes_per_sample']:,.0f} B/sample, "
                            f"{run['samples_per_s']:,.0f} samples/s, held-out accuracy {run['final_accuracy']:.3f}")
    results: dict[str, Any] = {
        name: {key: statistics.median(run[key] for run in rs)
               for key in ("bytes_per_sample", "samples_per_s", "final_accuracy")} | {"runs": rs}
        for name, rs in runs.items()}
    results["config"] = {"example": EXAMPLE.name, "batches": list(BATCHES)} | s

    def reduction(batch: int) -> float:
        return float(results[f"dense_b{batch}"]["bytes_per_sample"] / results[f"sparse_b{batch}"]["bytes_per_sample"])

    ratios = {
        "sparse_push_bytes_reduction": reduction(BATCHES[0]),
        f"sparse_push_bytes_reduction_batch{BATCHES[1]}": reduction(BATCHES[1]),
        "sparse_push_samples_per_s": results[f"sparse_b{BATCHES[0]}"]["samples_per_s"]
        / results[f"dense_b{BATCHES[0]}"]["samples_per_s"],
    }
    return results, ratios


def table(results: dict[str, Any]) -> str:
    return _common.table(
        [(name, f"{v['bytes_per_sample']:,.0f}", f"{v['samples_per_s']:,.0f}", f"{v['final_accuracy']:.3f}")
         for name, v in results.items() if name != "config"],
        ("pushes, batch", "bytes pushed / sample", "samples/s", "held-out accuracy"))
