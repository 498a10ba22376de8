"""The single-process torch baselines: ``python -m dniasync.compare._baseline CONFIG THREADS``.

Same model (the factory and the job seed), same split, the batch order of a one-shard job, the base
``[optimizer]`` as torch's (:func:`~dniasync.train.sync.make_optimizer`, as pipeline stages run it: torch's fused
CPU kernel where it has one, its fastest; a quarter of all-core torch's time on the 784-1024x4-10 MLP went to its
default Adagrad), the job's
evaluation schedule and stop rules; writes the job's ``summary.json`` and ``final_weights.safetensors``.
The clock counts training only: evaluations pause it, as a job's run on the coordinator beside training.
(:func:`~dniasync.train.pipeline.baseline.train_backprop` evaluates per epoch fraction and knows no stop
rule, so its pieces are reused here, not the loop.)
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from typing import Any

__all__ = ["train_baseline"]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def train_baseline(config_path: str, threads: int) -> int:
    import torch

    from ..cluster.config import load_config
    from ..cluster.plan import data_spec, model_spec
    from ..cluster.report import RunReport
    from ..train.data import ShardPlan
    from ..train.flat import evaluate, model_arrays
    from ..train.sync import make_optimizer

    config = load_config(config_path)
    torch.set_num_threads(threads or (os.cpu_count() or 1))
    model = model_spec(config).build()
    x, y, x_test, y_test = data_spec(config).load_split()
    o = config.optimizer
    momentum = o.momentum if o.name in ("momentum", "nesterov") else 0.0
    optimizer = make_optimizer(list(model.parameters()), o.name, o.lr, momentum=momentum, eps=o.epsilon,
                               betas=o.betas, weight_decay=o.weight_decay)
    report = RunReport(config.job.name, "torch", target_accuracy=config.stop.target_accuracy,
                       config=config.to_dict())
    shards = ShardPlan(config.data.n_train, 1, config.job.seed)
    stop, every = config.stop, config.eval
    wall, samples, steps = 0.0, 0, 0
    interval = every.interval_s or every.every_steps or 2.0

    def score() -> bool:
        accuracy, loss = evaluate(model, x_test, y_test)
        report.record_eval(wall, samples, accuracy, loss)
        return stop.target_accuracy is not None and accuracy >= stop.target_accuracy

    def train() -> str:
        nonlocal wall, samples, steps
        next_eval = interval
        for epoch in range(stop.max_epochs):
            order = torch.from_numpy(shards.indices(0, epoch))
            for start in range(0, len(order), config.data.batch_size):
                begun = time.perf_counter()
                idx = order[start:start + config.data.batch_size]
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx].long())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # type: ignore[no-untyped-call]
                if o.clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
                optimizer.step()
                wall += time.perf_counter() - begun
                samples, steps = samples + len(idx), steps + 1
                if (wall if every.interval_s else steps) >= next_eval:
                    next_eval += interval
                    if score():
                        return f"reached target accuracy {stop.target_accuracy:g}"
                if stop.max_seconds is not None and wall >= stop.max_seconds:
                    return f"ran {stop.max_seconds:g} s"
        return f"trained {stop.max_epochs} epochs"

    try:
        reason = train()
    except KeyboardInterrupt:
        reason = "stopped: interrupted"
    status = 130 if reason.startswith("stopped") else 0
    if status == 0 and (not report.history or report.history[-1].samples != samples):
        score()
    report.set_metric("train_samples_per_s", samples / wall if wall > 0 else 0.0)
    report.set_metric("torch_threads", torch.get_num_threads())
    report.set_metric("peak_rss_bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    report.set_final_weights(model_arrays(model))
    report.finish(max(wall, report.wall_s), samples, reason)
    path = report.write_outputs(config.output_dir)
    print(f"{config.job.name}: {reason}; {samples:,} samples in {wall:.1f} s; summary {path}", flush=True)
    return status


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(train_baseline(sys.argv[1], int(sys.argv[2])))
