"""The checks the repository declares, run by the test command: ruff (lint and import
order, `[tool.ruff]`), mypy (`[tool.mypy]`: every package, strict on `pipelines` and
`core`), and the doctests of the pure domain and of `core`."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing() -> None:
    result = _run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def _modules(package: str) -> list[str]:
    root = importlib.import_module(package)
    return [package] + [m.name for m in pkgutil.walk_packages(root.__path__, f"{package}.")]


@pytest.mark.parametrize("name", _modules("pipelines") + _modules("core"))
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
