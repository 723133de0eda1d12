# SPDX-FileCopyrightText: 2026 The kvpush Authors
# SPDX-License-Identifier: Apache-2.0
"""The whole tree passes ruff with pyproject.toml's rules (pyflakes, import order, bugbear, pyupgrade), and the house rules ruff cannot check."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    # The ruff wheel puts its binary beside the interpreter.
    ruff = pathlib.Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    """mypy over kvpush/, services/ and connector/ (kvpush.dev.typecheck) reports no error."""
    from kvpush.dev import typecheck

    result = typecheck.run(timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr


# Other ways to take a percentile, each its own definition: every report and benchmark uses kvpush.report.percentiles.
OTHER_PERCENTILES = ("np.percentile(", "numpy.percentile(", "statistics.quantiles(", "np.quantile(", "def percentile(")


def test_every_percentile_comes_from_the_one_definition():
    found = []
    for path in sorted(REPO_ROOT.glob("*/**/*.py")):
        relative = path.relative_to(REPO_ROOT)
        if relative.parts[0] in ("tests", ".venv") or relative == pathlib.Path("kvpush/report/percentiles.py"):
            continue
        text = path.read_text()
        found += [f"{relative}: {pattern}" for pattern in OTHER_PERCENTILES if pattern in text]
    assert not found, f"percentiles defined apart from kvpush.report.percentiles: {found}"


# ---- import contracts ---------------------------------------------------------------------------------------------------

# Where each installed package's modules live (pyproject.toml's package-dir).
PACKAGE_DIRS = {"kvpush.services": "services", "kvpush.connector": "connector", "kvpush": "kvpush"}
# Development tooling: the local stack, the simulation, the demo, the tiny models, codegen, the test etcd cluster and
# sample messages, all in one package.
TOOLING = "kvpush.dev"
# The grpc-free cores the servicers wrap.
CORES = ("kvpush.services.registrar.core", "kvpush.services.broker.core")


def module_path(name: str) -> pathlib.Path | None:
    """The source file of a module of the repository's packages, None for anything else."""
    for package, folder in PACKAGE_DIRS.items():
        if name == package or name.startswith(package + "."):
            parts = name[len(package):].strip(".").split(".") if name != package else []
            base = REPO_ROOT.joinpath(folder, *parts)
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.exists():
                    return candidate
            return None
    return None


def imported_names(path: pathlib.Path) -> set[str]:
    """Every module an `import` or `from ... import` in the file names (inside functions too), and from-imported submodules."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names if module_path(f"{node.module}.{alias.name}"))
    return names


def runtime_modules() -> list[tuple[str, pathlib.Path]]:
    modules = []
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(REPO_ROOT.joinpath(folder).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT / folder).with_suffix("").parts
            name = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts))).rstrip(".")
            if module_path(name) == path and not is_tooling(name) and (package != "kvpush" or parts[0] not in ("services", "connector")):
                modules.append((name, path))
    return modules


def is_tooling(name: str) -> bool:
    return name == TOOLING or name.startswith(TOOLING + ".")


def test_what_ships_imports_nothing_from_kvpush_dev_bench_or_tests():
    """What ships imports nothing from kvpush.dev, bench or tests."""
    found = [f"{name} imports {imported}" for name, path in runtime_modules() for imported in sorted(imported_names(path))
             if imported.partition(".")[0] in ("bench", "tests") or is_tooling(imported)]
    assert not found, found


def test_the_connector_imports_nothing_from_the_services():
    found = [f"{name} imports {imported}" for name, path in runtime_modules() if name.startswith("kvpush.connector")
             for imported in sorted(imported_names(path)) if imported.startswith("kvpush.services")]
    assert not found, found


def test_the_service_cores_import_no_grpc_even_through_what_they_import():
    for core in CORES:
        seen, todo, external = set(), [core], set()
        while todo:
            name = todo.pop()
            path = module_path(name)
            if name in seen or path is None:
                continue
            seen.add(name)
            for imported in imported_names(path):
                (todo.append if module_path(imported) else external.add)(imported)
        assert not {e for e in external if e.partition(".")[0] == "grpc"}, f"{core} reaches grpc: {sorted(e for e in external if e.startswith('grpc'))}"


MAX_MODULE_LINES = 450


def test_no_hand_written_module_is_over_450_lines():
    """Small modules with one job each: past this, a module holds more than one (generated protobuf code aside)."""
    found = []
    for folder in ("kvpush", "services", "connector", "bench", "tests", "scripts"):
        for path in sorted(REPO_ROOT.joinpath(folder).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > MAX_MODULE_LINES and "_pb2" not in path.name:
                found.append(f"{path.relative_to(REPO_ROOT)}: {lines}")
    assert not found, found
