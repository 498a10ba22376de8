"""The import arrows of DESIGN.md, checked where they matter at run time: what importing a layer loads.

``lint-imports`` (``.ci/run``) checks the same arrows statically; this test
imports every module of a layer in a fresh interpreter and looks at
``sys.modules``, so it also sees what an import pulls in through third parties.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_by(package: str) -> set[str]:
    """Every module loaded by importing ``package`` and all its submodules in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", PROBE, package], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


@pytest.mark.parametrize(("package", "forbidden"), [
    ("dniasync.actors", {"aiohttp", "torch", "dniasync.remote", "dniasync.metrics", "dniasync.train"}),
    ("dniasync.metrics", {"aiohttp", "dniasync.remote", "dniasync.train", "dniasync.cluster", "dniasync.node"}),
    ("dniasync.train", {"aiohttp", "dniasync.remote", "dniasync.cluster", "dniasync.node"}),
])
def test_a_layer_loads_nothing_above_it(package: str, forbidden: set[str]) -> None:
    assert loaded_by(package) & forbidden == set()


def test_the_mode_contract_loads_no_mode() -> None:
    """``cluster/mode_api.py`` is the leaf every mode, the registry and the config loader stand on."""
    probe = ("import json, sys, dniasync.cluster.mode_api; "
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('dniasync', 'torch')))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert "dniasync.cluster.mode_api" in loaded
    assert {m for m in loaded if m == "dniasync.cluster.modes" or m.startswith("dniasync.cluster.modes.")} == set()
    assert {m for m in loaded if m.split(".")[0] == "torch"} == set()
    assert loaded & {"dniasync.cluster.config", "dniasync.cluster.job", "dniasync.cluster.hosts"} == set()
