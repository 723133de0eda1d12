# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""pyproject.toml installs every package folder under its import name."""

from __future__ import annotations

import pathlib
import tomllib

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# Import name prefix -> folder: kvpush/ is itself, services/ and connector/
# install inside it.
PACKAGE_DIRS = {"kvpush": "kvpush", "kvpush.services": "services", "kvpush.connector": "connector"}


def setuptools_config() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_folders() -> dict[str, pathlib.Path]:
    """Returns every folder holding an __init__.py, by the import name it must install as."""
    found = {}
    for prefix, folder in PACKAGE_DIRS.items():
        root = REPO_ROOT / folder
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(root).parts
            found[".".join((prefix, *relative))] = init.parent
    return found


def test_package_dir_maps_services_and_connector_into_kvpush():
    assert setuptools_config()["package-dir"] == PACKAGE_DIRS


def test_every_package_folder_is_listed():
    listed = set(setuptools_config()["packages"])
    missing = sorted(set(package_folders()) - listed)
    assert missing == [], f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_every_listed_package_exists():
    found = package_folders()
    absent = sorted(name for name in setuptools_config()["packages"] if name not in found)
    assert absent == [], f"listed in pyproject.toml but no folder with __init__.py: {absent}"
