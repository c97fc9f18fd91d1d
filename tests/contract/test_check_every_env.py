"""`bpo check-sandbox` passes, through the command line, for every shipped environment."""

import os
import subprocess
import sys

import pytest

from bpo.sandbox.envs import load_all

# Small task choices keep this quick; each env's own contract tests go deeper.
ARGS = {
    "toy": [],
    "mdp": [],
    "textworld": ["--task", "tw-coin_collector/level=1/seed=0"],
    "twx": ["--task", "coin/seed=1/numLocations=3"],
    "alfworld": ["--tasks", "1"],
    "scienceworld": ["--task", "boil/var=0", "--option", "admissible=false"],
    "code": ["--tasks", "1"],
    "web": ["--tasks", "2"],
}


def test_every_registered_env_is_covered():
    assert set(load_all().names()) == set(ARGS)


@pytest.mark.env
@pytest.mark.parametrize("env", sorted(ARGS))
def test_check_sandbox_cli_passes(env):
    cmd = [sys.executable, "-m", "bpo.cli", "check-sandbox", env, "--max-steps", "6",
           "--stress-nodes", "8", *ARGS[env]]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=540,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
