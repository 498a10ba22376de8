"""bench_data's sparse pushes (#29): Downpour on the fastText example's job, dense against sparse pushes.

The job is ``examples/text_reviews_fasttext.toml`` (an EmbeddingBag model and a Linear layer; 2 replicas, 1 PS
shard, Adagrad) for a fixed number of epochs (no target), with ``[downpour] sparse = false`` and ``"auto"`` (only
the rows a batch touched are pushed), on its seeded reviews:

- as shipped: converted with the WordPiece tokenizer into an 8,192-row table, at the example's batch of 32 and at
  16 (a batch touches fewer of the table's rows);
- hashed: the same reviews by feature hashing into 65,536 buckets (``--tokenizer hash --vocab-size 65536``), the
  table a real review corpus needs (fastText's default is 2M buckets; Amazon's reviews have hundreds of thousands
  of distinct words), at the batch of 32. This is the table ``sparse_push_bytes_reduction`` is measured on: how
  much a sparse push saves is the fraction of the table a batch leaves untouched, which the shipped example's small
  synthetic vocabulary understates.

Per run: bytes pushed per sample (what went on the wire: values and spans), samples/s (training time, start-up
excluded) and held-out accuracy. Dense and sparse runs alternate, so a noisy neighbour hits both alike.
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
VARIANTS = {
    # name: (tokenizer options, table rows, batch)
    "b32": (("--tokenizer", "wordpiece"), 8192, 32),
    "b16": (("--tokenizer", "wordpiece"), 8192, 16),
    "hashed64k_b32": (("--tokenizer", "hash", "--vocab-size", "65536"), 65536, 32),
}
"""The example as shipped at its batch and at a smaller one; a table of a real corpus's size."""
HEADLINE = "hashed64k_b32"
SETTINGS = {True: {"epochs": 1, "repeat": 1}, False: {"epochs": 3, "repeat": 3}}
"""By ``--quick``."""


def job(tmp: Path, dataset: Path, name: str, sparse: str, batch: int, epochs: int, rows: int) -> tuple[Path, Path]:
    """The example's job on ``dataset`` (a table of ``rows``) with ``sparse`` pushes, ``batch``, ``epochs`` and no
    target: (config, out)."""
    out = tmp / name
    text = EXAMPLE.read_text()
    for old, new in (('dataset = "runs/text_reviews/reviews"', f'dataset = "{dataset}"'),
                     ('output_dir = "runs/text_reviews_fasttext"', f'output_dir = "{out}"'),
                     ('sparse = "auto"', f"sparse = {sparse}"), ("batch_size = 32", f"batch_size = {batch}"),
                     ("vocab_size = 8192", f"vocab_size = {rows}"),
                     ("max_epochs = 6", f"max_epochs = {epochs}"), ("target_accuracy = 0.95\n", "")):
        if old not in text:
            raise RuntimeError(f"{EXAMPLE} no longer has {old!r}: update {__name__}.job")
        text = text.replace(old, new)
    config = tmp / f"{name}.toml"
    config.write_text(text)
    return config, out


def measure(tmp: Path, quick: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """(results by ``<dense|sparse>_<variant>`` with the runs, ratios)."""
    from dniasync.train.data.text import generate_reviews

    s = SETTINGS[quick]
    source = generate_reviews(tmp / "reviews.jsonl", 6000, seed=0)
    datasets: dict[tuple[str, ...], Path] = {}
    for options, _, _ in VARIANTS.values():
        if options not in datasets:
            dest = datasets[options] = tmp / f"reviews-{len(datasets)}"
            subprocess.run([sys.executable, "-m", "dniasync.data", "convert", str(source), str(dest), "--text",
                            "--label-offset", "1", "--max-len", "48", "--quiet", *options], check=True,
                           capture_output=True, timeout=300)
    runs: dict[str, list[dict[str, Any]]] = {}
    for variant, (options, rows, batch) in VARIANTS.items():
        for r in range(s["repeat"]):
            for pushes, sparse in (("dense", "false"), ("sparse", '"auto"')):
                name = f"{pushes}_{variant}"
                config, out = job(tmp, datasets[options], f"{name}_{r}", sparse, batch, s["epochs"], rows)
                done = subprocess.run([sys.executable, "-m", "dniasync.node", "--role", "local", "--config",
                                       str(config)], capture_output=True, text=True, timeout=1800)
                if done.returncode != 0:
                    raise RuntimeError(f"{config.name} failed:\n{(done.stdout + done.stderr)[-3000:]}")
                doc = json.loads((out / "summary.json").read_text())
                run = {"samples": doc["samples"], "samples_per_s": doc["samples_per_s"],
                       "bytes_pushed": doc["bytes_pushed"], "dense_bytes_pushed": doc["metrics"]["dense_bytes_pushed"],
                       "bytes_per_sample": doc["bytes_pushed"] / doc["samples"],
                       "final_accuracy": doc["final_accuracy"], "table_rows": rows, "batch_size": batch}
                runs.setdefault(name, []).append(run)
                _common.say(f"  {name} run {r + 1}: {run['bytes_per_sample']:,.0f} B/sample, "
                            f"{run['samples_per_s']:,.0f} samples/s, held-out accuracy {run['final_accuracy']:.3f}")
    results: dict[str, Any] = {
        name: {key: statistics.median(run[key] for run in rs)
               for key in ("bytes_per_sample", "samples_per_s", "final_accuracy")} | {"runs": rs}
        for name, rs in runs.items()}
    results["config"] = {"example": EXAMPLE.name, "variants": {k: {"tokenizer": list(v[0]), "table_rows": v[1],
                                                                   "batch_size": v[2]} for k, v in VARIANTS.items()},
                         "headline": HEADLINE} | s

    def ratio(variant: str, key: str, dense_over_sparse: bool) -> float:
        dense, sparse = results[f"dense_{variant}"][key], results[f"sparse_{variant}"][key]
        return float(dense / sparse if dense_over_sparse else sparse / dense)

    ratios = {
        "sparse_push_bytes_reduction": ratio(HEADLINE, "bytes_per_sample", True),
        "sparse_push_samples_per_s": ratio(HEADLINE, "samples_per_s", False),
        "sparse_push_bytes_reduction_8192_rows": ratio("b32", "bytes_per_sample", True),
        "sparse_push_bytes_reduction_8192_rows_batch16": ratio("b16", "bytes_per_sample", True),
        "sparse_push_samples_per_s_8192_rows": ratio("b32", "samples_per_s", False),
    }
    return results, ratios


def table(results: dict[str, Any]) -> str:
    return _common.table(
        [(name, f"{v['bytes_per_sample']:,.0f}", f"{v['samples_per_s']:,.0f}", f"{v['final_accuracy']:.3f}")
         for name, v in results.items() if name != "config"],
        ("pushes, table and batch", "bytes pushed / sample", "samples/s", "held-out accuracy"))
