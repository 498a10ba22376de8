"""The README and the documentation site say only what runs.

- Every Python and shell block of README.md and docs/**/*.md is run, or the line before it says why not
  (``<!-- not run: REASON -->``). A shell block whose commands are all
  ``python -m dniasync.node --role local --config examples/X.toml`` is covered by the short run of X below.
- Every TOML block is parsed by the job config parser, which refuses unknown keys: a block that is not a whole
  job is laid over an example (``<!-- toml base: examples/X.toml -->``, or one chosen by its tables).
- Every ``examples/*.toml`` parses, and runs briefly through the local launcher (one epoch of 1,000 rows).
- The generated references (command line, metrics) are current; every event kind the code defines is listed.
- Relative links of the README point at files that exist (the site's own links are checked by
  ``mkdocs build --strict`` in .ci/run).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dniasync.cluster.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))

ALREADY_RUN = {
    "dni_p2p_mnist.toml": "tests/test_dni_cluster.py runs it for 8 epochs",
    "downpour_shm_mnist.toml": "tests/test_train_cluster.py runs it as shipped",
    "text_reviews_fasttext.toml": "tests/test_text.py runs its job as shipped, on a data set of each tokenizer",
}
"""Examples another test already runs through the launcher: parsed here, not run twice."""

SHELL = {"bash", "sh", "shell", "console"}
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>[^>]*?)\s*-->")
TOML_BASE = re.compile(r"<!--\s*toml base:\s*(?P<path>\S+)\s*-->")
LAUNCH = re.compile(r"^python -m dniasync\.node --role local --config examples/(?P<name>[\w.-]+\.toml)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    marker: str
    """The HTML comment on the line before the fence, if any."""

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1)))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = before if before.startswith("<!--") else ""
        found.append(Block(page, i + 1, fence.group(2).lower(), "\n".join(lines[i + 1:end]), marker))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL if (b.lang == "python" or b.lang in SHELL) and not NOT_RUN.search(b.marker)]
TOML = [b for b in ALL if b.lang == "toml" and not NOT_RUN.search(b.marker)]


def commands(block: Block) -> list[str]:
    """The block's commands, comments and blank lines left out."""
    out = []
    for line in block.code.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(shlex.join(words))
    return out


def launched_example(block: Block) -> list[str] | None:
    """The examples a shell block runs, when running examples is all it does."""
    names = [LAUNCH.match(c) for c in commands(block)]
    return [m.group("name") for m in names if m] if names and all(names) else None


def test_every_block_is_run_or_says_why_not() -> None:
    assert len(PAGES) > 20 and len(ALL) > 40, "the documentation pages or their blocks were not found"
    unmarked = [b.id for b in ALL if b.lang in ("", "py", "sh-session")]
    assert not unmarked, f"fences without a language (python, bash, toml, text): {unmarked}"
    for b in ALL:
        reason = NOT_RUN.search(b.marker)
        if reason:
            assert len(reason.group("why")) >= 10, f"{b.id}: say why the block is not run"


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.lang in SHELL], ids=lambda b: b.id)
def test_shell_block_runs(block: Block) -> None:
    examples = launched_example(block)
    if examples is not None:
        for name in examples:
            assert (ROOT / "examples" / name).exists(), f"{block.id}: no examples/{name}"
        return  # each example's short run is test_example_runs_briefly below
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout}{done.stderr}"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _base_for(block: Block, doc: dict[str, Any]) -> Path | None:
    explicit = TOML_BASE.search(block.marker)
    if explicit:
        return ROOT / explicit.group("path")
    if {"job", "model", "data"} <= doc.keys():
        return None  # a whole job
    mode = doc.get("job", {}).get("mode")
    for table, example in (("sandblaster", "sandblaster_mnist"), ("hogwild", "hogwild_mnist"), ("p2p", "p2p_mnist"),
                           ("pipeline", "dni_mnist"), ("regroup", "dni_mnist")):
        if table in doc or mode == table:
            return ROOT / "examples" / f"{example}.toml"
    return ROOT / "examples" / "downpour_mnist.toml"


@pytest.mark.parametrize("block", TOML, ids=lambda b: b.id)
def test_toml_block_is_a_valid_job_config(block: Block) -> None:
    doc = tomllib.loads(block.code)
    base = _base_for(block, doc)
    raw = doc if base is None else _merge(tomllib.loads(base.read_text()), doc)
    parse_config(raw)  # a ConfigError names the key


def test_a_removed_key_fails_the_toml_check() -> None:
    """What the TOML blocks rely on: a key the schema does not know is refused, naming it."""
    block = next(b for b in TOML if "warm_start_steps" in b.code)
    renamed = Block(block.page, block.line, "toml", block.code.replace("warm_start_steps", "warm_steps"), block.marker)
    with pytest.raises(Exception, match="downpour.warm_steps"):
        test_toml_block_is_a_valid_job_config(renamed)


def _run_example(path: Path, out_dir: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One short epoch of an example through the local launcher: its result and its output directory."""
    raw = tomllib.loads(path.read_text())
    config = parse_config(raw)
    raw["job"]["output_dir"] = str(out_dir / "out")
    raw["stop"] = {"max_epochs": 1, "max_seconds": 60.0}
    raw["data"] |= {"n_train": 1000, "n_test": 200}  # one short epoch: start-up is most of the run
    if config.mode == "sandblaster":
        raw["sandblaster"]["max_iterations"] = 2
    job = out_dir / path.name
    job.write_text(_toml(raw))
    done = subprocess.run([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(job)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    return done, out_dir / "out"


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Every example not run elsewhere, two at a time (start-up, mostly imports, is most of each run and
    leaves a core idle between the launcher's processes): the CI minutes this costs, cut by about a third. (Three at
    a time was slower here: 198 s against 166 s.)"""
    from concurrent.futures import ThreadPoolExecutor

    todo = [p for p in EXAMPLES if p.name not in ALREADY_RUN]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {p.name: pool.submit(_run_example, p, tmp_path_factory.mktemp(p.stem)) for p in todo}
        return {name: future.result() for name, future in runs.items()}


@pytest.mark.timeout(900)  # the first one's setup runs them all (78 s alone here, 143 s beside another test file)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_briefly(path: Path, example_runs: dict[str, tuple[subprocess.CompletedProcess[str], Path]]) -> None:
    parse_config(tomllib.loads(path.read_text()))
    if path.name in ALREADY_RUN:
        pytest.skip(ALREADY_RUN[path.name])
    done, out = example_runs[path.name]
    assert done.returncode == 0, f"{path.name}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples"] > 0 and summary["history"], f"{path.name} trained nothing: {summary['stop_reason']}"


def _toml(doc: dict[str, Any], prefix: str = "") -> str:
    """A TOML file of ``doc`` (tables of scalars, arrays and nested tables: what job configs hold)."""
    scalars = [f"{k} = {json.dumps(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    text = "\n".join(scalars) + "\n"
    for k, v in doc.items():
        if isinstance(v, dict):
            text += f"\n[{prefix}{k}]\n" + _toml(v, f"{prefix}{k}.")
    return text


def test_every_example_a_page_runs_is_run_briefly() -> None:
    named = {n for b in RUNNABLE if b.lang in SHELL for n in (launched_example(b) or [])}
    assert named <= {p.name for p in EXAMPLES}, f"pages run examples that do not exist: {named - {p.name for p in EXAMPLES}}"


def test_generated_references_are_current() -> None:
    done = subprocess.run([sys.executable, str(DOCS / "scripts" / "gen_reference.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_every_event_kind_is_listed() -> None:
    defined = set()
    for path in (ROOT / "python" / "dniasync").rglob("*.py"):
        defined |= set(re.findall(r'^EVENT_\w+(?:: Final)? = "(\w+)"', path.read_text(), re.M))
    page = (DOCS / "reference" / "events.md").read_text()
    assert len(defined) > 15, "no event constants found: has their spelling changed?"
    missing = sorted(kind for kind in defined if f"| `{kind}` |" not in page)
    assert not missing, f"docs/reference/events.md does not list {missing}"


def test_readme_is_short_and_its_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"

