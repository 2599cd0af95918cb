"""The code base stays ruff-clean (rules in pyproject.toml): lint is part of the test command."""

import shutil
import subprocess

import pytest
from conftest import REPO


def test_ruff_check_passes():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -r requirements-dev.txt")
    proc = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
