"""The wheel holds every package of the source tree: ``[tool.setuptools] packages`` is an explicit list
(``writer/`` and ``integrations/`` are mapped under ``ckptstore``), so a package missing from it exists in
an editable install and not in a wheel. Issue 20 turned ``cli.py`` and ``attached.py`` into packages; the
list had already missed ``ckptstore.storage``, so an installed ``ckptstore`` command could not import."""

from __future__ import annotations

import importlib
import os

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setuptools() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _source_packages(package_dir: dict[str, str]) -> set[str]:
    """Every package under the mapped roots: a directory holding an ``__init__.py``."""
    found: set[str] = set()
    for name, root in package_dir.items():
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, root)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, os.path.join(REPO, root))
                found.add(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    return found


def test_every_source_package_is_in_the_wheel_and_every_listed_one_exists() -> None:
    conf = _setuptools()
    listed = set(conf["packages"])
    source = _source_packages(conf["package-dir"])
    assert "ckptstore.cli" in source  # control: the walk sees the packages it must find
    assert source - listed == set(), f"packages missing from [tool.setuptools] packages: {sorted(source - listed)}"
    assert listed - source == set(), f"listed packages that do not exist: {sorted(listed - source)}"


def test_the_console_script_names_a_callable() -> None:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["ckptstore"]
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func))
