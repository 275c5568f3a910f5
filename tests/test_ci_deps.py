""".ci/deps.sh tests the range setup.cfg claims: its floors must be the floors setup.cfg
states, or CI would go on testing a range nobody claims any more."""
from __future__ import annotations

import configparser
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, ".ci", "deps.sh")
pytestmark = pytest.mark.no_torch


def _claimed() -> dict:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    floors = {}
    for line in cfg["options"]["install_requires"].split("\n"):
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)>=([0-9.]+)\s*", line)
        if m:
            floors[m.group(1).lower()] = m.group(2)
    return floors


def _script_var(name: str) -> str:
    with open(SCRIPT) as f:
        m = re.search(rf"^{name}=(\S+)", f.read(), re.M)
    assert m, f"{name} is not set in .ci/deps.sh"
    return m.group(1)


def _release(version: str):
    return tuple(int(p) for p in version.split("."))


@pytest.mark.parametrize("package,var", [("cloudpickle", "CLOUDPICKLE_FLOOR"),
                                         ("tblib", "TBLIB_FLOOR"),
                                         ("torch", "TORCH_FLOOR")])
def test_each_floor_ci_tests_is_the_one_setup_cfg_claims(package, var):
    """The same release line (torch 2.1 is tested as 2.1.2, its last bug-fix release;
    cloudpickle 2.2 as 2.2.0 itself)."""
    claimed = _release(_claimed()[package])
    tested = _release(_script_var(var))
    assert tested[:len(claimed)] == claimed, (package, claimed, tested)


def test_the_ray_floor_ci_tests_is_the_one_the_extra_claims():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    lines = cfg["options.extras_require"]["ray"].split("\n")
    floors = [m.group(1) for m in (re.fullmatch(r"\s*ray>=([0-9.]+)\s*", line)
                                   for line in lines) if m]
    assert len(floors) == 1, lines
    claimed, tested = _release(floors[0]), _release(_script_var("RAY_FLOOR"))
    assert tested[:len(claimed)] == claimed, (claimed, tested)


def test_the_script_parses_and_ci_runs_it():
    subprocess.run(["bash", "-n", SCRIPT], check=True)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "bash .ci/deps.sh" in f.read()
