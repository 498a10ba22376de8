"""The plan: one job config per method (and seed), checked by the project's own parser before anything runs.

A method is a registered mode (``downpour``, ``hogwild``, ``p2p``, ``sandblaster``, ...: sized by its
``shards_key``), a pipeline rule (``pipeline:<rule>``, one pipeline of ``workers`` stages;
``pipeline:<rule>+ps``, ``workers / stages`` pipelines sharing weights through PS shards), or a
single-process torch baseline (``torch:1thread``, ``torch:all-cores``). The names come from the mode and
rule registries, never from a list here.

Each method's config is the base (the file without ``[compare]``, without the other modes' sections),
shaped for the method, then deep-merged with ``[compare.<mode>]`` and ``[compare."<method>"]``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

__all__ = ["CompareError", "MethodPlan", "Plan", "known_methods", "make_plan", "read_base", "to_toml"]

TORCH: Final = "torch"
TORCH_METHODS: Final[dict[str, int]] = {"torch:1thread": 1, "torch:all-cores": 0}
"""The single-process baselines and their torch threads (0: every core)."""
PS_SUFFIX: Final = "+ps"
_COMPARE_KEYS: Final = {"workers": "worker processes of every method (default: those of the file's own job)",
                        "stages": "stages of a replicated pipeline (`pipeline:<rule>+ps`; default: the file's "
                                  "pipeline.groups, else 2)"}
_PER_RUN_JOB_KEYS: Final = ("name", "seed", "output_dir")
"""job keys compare sets per run: not differences between methods."""
_BASELINE_CARRIER: Final = "hogwild"
"""The baselines' files are one-worker Hogwild jobs: the project's parser types their common sections (model,
data, optimizer, stop, eval); the single-process trainer reads only those."""
_BASELINE_SECTIONS: Final = ("job", "model", "data", "optimizer", "stop", "eval")


class CompareError(ValueError):
    """Bad input to ``compare``: exit status 2, nothing written."""


@dataclass
class MethodPlan:
    """One method: its config for the first seed (None if it cannot run the job, with the reason)."""

    method: str
    mode: str
    threads: int | None = None
    """torch threads of a baseline (0: all cores); None for a job run through the launcher."""
    config: dict[str, Any] | None = None
    reason: str | None = None
    differences: list[str] = field(default_factory=list)
    workers: int = 0
    ps: int = 0

    def for_seed(self, seed: int, out: Path) -> dict[str, Any]:
        """The config of the run with job seed ``seed``, writing into ``out``."""
        assert self.config is not None
        raw = copy.deepcopy(self.config)
        job = raw["job"]
        job["seed"] = seed
        job["name"] = f"{job['name']}-s{seed}"
        job["output_dir"] = str(out)
        return raw


@dataclass
class Plan:
    base: dict[str, Any]
    name: str
    base_seed: int
    workers: int
    methods: list[MethodPlan]
    targets: tuple[float, ...]


def read_base(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's job config (without ``[compare]``) and its ``[compare]`` table."""
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise CompareError(f"{path}: no such config file") from None
    except OSError as exc:
        raise CompareError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CompareError(f"{path}: not valid TOML: {exc}") from None
    compare = raw.pop("compare", {})
    if not isinstance(compare, dict):
        raise CompareError(f"{path}: [compare] must be a table")
    return raw, compare


def _rules() -> tuple[str, ...]:
    from ..train.pipeline.rules import RULES

    return tuple(RULES)


def _modes() -> dict[str, Any]:
    from ..cluster.modes import MODES

    return dict(MODES)


def _pipeline_mode() -> str:
    from ..cluster.modes.pipeline import PIPELINE

    return PIPELINE.name


def known_methods() -> list[str]:
    """Every method name compare takes, from the registries."""
    pipeline = _pipeline_mode()
    names = [m for m in _modes() if m != pipeline]
    for rule in _rules():
        names += [f"{pipeline}:{rule}", f"{pipeline}:{rule}{PS_SUFFIX}"]
    return names + list(TORCH_METHODS)


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise CompareError("--methods is empty")
    known = known_methods()
    for m in methods:
        if m not in known:
            hint = ""
            if m == _pipeline_mode():
                hint = f" (a pipeline needs its rule: {_pipeline_mode()}:<rule>, e.g. {_pipeline_mode()}:{_rules()[0]})"
            raise CompareError(f"unknown method {m!r}{hint}; known methods: {', '.join(known)}")
    dup = sorted({m for m in methods if methods.count(m) > 1})
    if dup:
        raise CompareError(f"method(s) named twice in --methods: {', '.join(dup)}")
    return methods


def _check_compare_table(compare: Mapping[str, Any]) -> None:
    known = set(known_methods()) | set(_modes()) | {TORCH}
    for key, value in compare.items():
        if key in _COMPARE_KEYS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CompareError(f"'compare.{key}' must be an integer >= 1, got {value!r}")
        elif isinstance(value, dict):
            if key not in known:
                raise CompareError(f"[compare.\"{key}\"] names no method or mode; known: {', '.join(sorted(known))}")
        else:
            raise CompareError(f"unknown key 'compare.{key}': [compare] takes "
                               + ", ".join(f"{k} ({d})" for k, d in _COMPARE_KEYS.items())
                               + " and a table of overrides per method or mode, e.g. [compare.\"pipeline:cdni\"]")


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``: tables merge key by key, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def flatten(table: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from flatten(value, dotted + ".")
        else:
            yield dotted, value


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def differences(base: Mapping[str, Any], raw: Mapping[str, Any], sections: tuple[str, ...] | None = None) -> list[str]:
    """Every key whose value in ``raw`` is not the base's (``sections``: only those), and keys dropped from
    sections both have."""
    def keep(key: str) -> bool:
        section = key.split(".", 1)[0]
        return (sections is None or section in sections) and key not in {f"job.{k}" for k in _PER_RUN_JOB_KEYS}

    before = {k: v for k, v in flatten(base) if keep(k)}
    after = {k: v for k, v in flatten(raw) if keep(k)}
    out = []
    for key, value in after.items():
        if key not in before:
            out.append(f"{key} = {_show(value)}")
        elif before[key] != value:
            out.append(f"{key} = {_show(value)} (base {_show(before[key])})")
    shared = {k.split(".", 1)[0] for k in after}
    out += [f"{key} dropped (base {_show(v)})" for key, v in before.items()
            if key not in after and key.split(".", 1)[0] in shared]
    return out


def to_toml(raw: Mapping[str, Any]) -> str:
    """TOML text of plain data (tables, arrays, strings, numbers, booleans): what the launcher reads back."""
    lines: list[str] = []

    def key(k: str) -> str:
        return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{key(k)} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"cannot write {type(v).__name__} as TOML")

    def table(name: str, t: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in t.items() if not (isinstance(v, dict) and v)}
        if name and (scalars or not t):
            lines.append(f"[{name}]")
        lines.extend(f"{key(k)} = {value(v)}" for k, v in scalars.items())
        if scalars:
            lines.append("")
        for k, v in t.items():
            if isinstance(v, dict) and v:
                table(f"{name}.{key(k)}" if name else key(k), v)

    table("", raw)
    return "\n".join(lines) + "\n"


def _cut_points(model: Any) -> list[int]:
    """Where a stage may start: at a layer with parameters whose predecessor has none (after an activation)."""
    def has_params(layer: Any) -> bool:
        return any(True for _ in layer.parameters())

    return [i for i in range(1, len(model)) if has_params(model[i]) and not has_params(model[i - 1])]


def auto_groups(model: Any, stages: int) -> list[list[int]]:
    """``model`` (an ``nn.Sequential``) cut into ``stages`` contiguous groups, the largest group's parameters
    as few as possible; ValueError if it has fewer places to cut."""
    from itertools import combinations

    from torch import nn

    if not isinstance(model, nn.Sequential):
        raise ValueError(f"the model is a {type(model).__name__}, not an nn.Sequential: it cannot be cut into stages")
    points = _cut_points(model)
    if len(points) < stages - 1:
        raise ValueError(f"the model has {len(points) + 1} parametrised blocks: it cannot be cut into {stages} stages")
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model]
    best: tuple[int, tuple[int, ...]] | None = None
    for cuts in combinations(points, stages - 1):
        bounds = (0, *cuts, len(model))
        worst = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best is None or worst < best[0]:
            best = (worst, cuts)
    assert best is not None
    bounds = (0, *best[1], len(model))
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def _drop_inapplicable(raw: dict[str, Any], section: str, cls: Any, notes: list[str]) -> None:
    """Base keys that apply only to other values of a sibling key (sg_lr beside a real-gradient rule) go."""
    table = raw.get(section)
    if not isinstance(table, dict):
        return
    for key, (sibling, values) in cls.only_for.items():
        actual = table.get(sibling, _default(cls, sibling))
        if key in table and actual not in values:
            del table[key]
            notes.append(f"{section}.{key} dropped (applies only when {section}.{sibling} is "
                         f"{' or '.join(map(repr, values))})")


def _default(cls: Any, name: str) -> Any:
    import msgspec.inspect as mi

    for f in mi.type_info(cls).fields:  # type: ignore[attr-defined]
        if f.name == name:
            return f.default
    return None


def _base_workers(base: dict[str, Any]) -> int:
    from ..cluster.config import ConfigError, parse_config
    from ..cluster.modes import get_mode

    if "mode" not in base.get("job", {}):
        raise CompareError("set [compare] workers = N (the file's job has no job.mode to take it from)")
    try:
        config = parse_config(base, resolve=False)
    except ConfigError as exc:
        raise CompareError(f"the file's own job is not valid ({exc}); set [compare] workers = N, or fix it") from None
    return get_mode(config.mode).processes(config)[1]


def make_plan(path: str, methods: list[str], targets: tuple[float, ...] | None) -> Plan:
    """Every method's config, each validated by the project's parser (an inapplicable one gets its reason)."""
    base, compare = read_base(path)
    _check_compare_table(compare)
    job = base.get("job", {})
    if not isinstance(job, dict):
        raise CompareError(f"{path}: [job] must be a table")
    workers = int(compare["workers"]) if "workers" in compare else _base_workers(base)
    if targets is None:
        stop = base.get("stop", {})
        target = stop.get("target_accuracy") if isinstance(stop, dict) else None
        targets = (float(target),) if isinstance(target, int | float) and not isinstance(target, bool) else ()
    name = str(job.get("name", Path(path).stem))
    plan = Plan(base, name, int(job.get("seed", 0)), workers, [], targets)
    for method in methods:
        plan.methods.append(_plan_method(base, compare, method, workers, name))
    return plan


def _shape(base: dict[str, Any], compare: Mapping[str, Any], method: str, workers: int,
           notes: list[str]) -> tuple[str, dict[str, Any]]:
    """(job mode, the method's config before its overrides); ValueError with the reason it cannot run."""
    from ..cluster.config import OptimizerConfig
    from ..cluster.modes import get_mode
    from ..train.models import build_model

    modes = _modes()
    pipeline = _pipeline_mode()
    mode_name = TORCH if method in TORCH_METHODS else method.split(":", 1)[0]
    carrier = _BASELINE_CARRIER if mode_name == TORCH else mode_name
    raw = {k: copy.deepcopy(v) for k, v in base.items() if k not in modes or k == carrier}
    if mode_name == TORCH:
        raw = {k: v for k, v in raw.items() if k in _BASELINE_SECTIONS}
        raw[carrier] = {"n_workers": 1}
    raw.setdefault("job", {})["mode"] = carrier
    mode = get_mode(carrier)
    for section, honoured in (("schedule", mode.schedules), ("regroup", mode.regroups)):
        if section in raw and not honoured:
            del raw[section]
            notes.append(f"[{section}] dropped (mode {carrier!r} does not honour it)")
    settings = raw.setdefault(carrier, {})
    if mode_name == pipeline:
        rule, replicated = method.split(":", 1)[1], method.endswith(PS_SUFFIX)
        rule = rule.removesuffix(PS_SUFFIX)
        given = settings.get("groups")
        if replicated:
            stages = int(compare.get("stages", len(given) if isinstance(given, list) and len(given) >= 2 else 2))
            if workers % stages or workers // stages < 2:
                raise ValueError(f"{workers} worker processes are not {stages} stages x 2 or more replicas "
                                 "(set [compare] workers or stages)")
            replicas = workers // stages
        else:
            stages, replicas = workers, 1
        if stages < 2 and not replicated:
            raise ValueError(f"{workers} worker process(es) make a pipeline of {stages} stage: nothing to pipeline")
        if not (isinstance(given, list) and len(given) == stages):
            model = raw.get("model", {})
            built = build_model(model.get("factory", ""), model.get("kwargs", {}), seed=0)
            settings["groups"] = auto_groups(built, stages)
        settings.pop("placement", None)
        settings.update(method=rule, replicas=replicas)
        _drop_inapplicable(raw, carrier, mode.settings, notes)
    elif mode_name != TORCH:
        section, key = mode.shards_key.split(".", 1)
        raw.setdefault(section, {})[key] = workers
    _drop_inapplicable(raw, "optimizer", OptimizerConfig, notes)
    return carrier, raw


def _plan_method(base: dict[str, Any], compare: Mapping[str, Any], method: str, workers: int,
                 name: str) -> MethodPlan:
    from ..cluster.config import ConfigError, parse_config
    from ..cluster.modes import get_mode

    mode_name = TORCH if method in TORCH_METHODS else method.split(":", 1)[0]
    plan = MethodPlan(method, mode_name, threads=TORCH_METHODS.get(method))
    notes: list[str] = []
    try:
        carrier, raw = _shape(base, compare, method, workers, notes)
    except (ValueError, ConfigError) as exc:
        plan.reason = str(exc)
        return plan
    except Exception as exc:  # a model factory may raise anything: the method is listed with it
        plan.reason = f"its model cannot be built: {exc!r}"
        return plan
    for key in dict.fromkeys((mode_name, method)):  # the mode's overrides, then the method's own
        over = compare.get(key)
        if isinstance(over, dict):
            raw = deep_merge(raw, over)
    raw["job"]["mode"] = carrier
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", method.replace("+", "-"))
    raw["job"]["name"] = f"{name}-{slug}"
    if plan.threads is not None:
        overrides = {**compare.get(TORCH, {}), **compare.get(method, {})}
        plan.differences = [f"{method}: one process, "
                            f"{'1 torch thread' if plan.threads == 1 else f'all {os.cpu_count()} cores'}"]
        plan.differences += differences(base, raw, _BASELINE_SECTIONS[1:])
        stray = sorted(set(overrides) - set(_BASELINE_SECTIONS))
        if stray:
            plan.reason = f"[compare.\"{method}\"] sets {', '.join(stray)}: a torch baseline takes only " \
                          f"{', '.join(_BASELINE_SECTIONS[1:])}"
            return plan
    else:
        plan.differences = differences(base, raw)
    noted = {note.split(" ", 1)[0] for note in notes}  # a key dropped with its reason is said once
    plan.differences = [d for d in plan.differences if not (d.split(" ", 1)[0] in noted and " dropped " in d)]
    plan.differences += notes
    try:
        config = parse_config(raw, resolve=True)
    except ConfigError as exc:
        plan.reason = f"its job is not valid: {exc}"
        return plan
    except Exception as exc:  # a model factory may raise anything: the method is listed with it
        plan.reason = f"its job cannot be built: {exc!r}"
        return plan
    if plan.threads is None:
        plan.ps, plan.workers = get_mode(config.mode).processes(config)
        if plan.workers != workers:
            plan.reason = f"it runs {plan.workers} worker processes as configured, not {workers}"
            return plan
    else:
        plan.workers = 1
    plan.config = raw
    return plan
