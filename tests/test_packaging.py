"""The package ships what users run: no module of moeferry/ imports the test fixtures or the
benchmarks, which live beside it in a source checkout and are not installed."""

import ast
import os

import moeferry

PACKAGE = os.path.dirname(moeferry.__file__)


def imported_roots(path: str) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_module_of_the_package_imports_tests_or_benchmarks():
    offenders = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                if imported_roots(path) & {"tests", "benchmarks"}:
                    offenders.append(os.path.relpath(path, PACKAGE))
    assert offenders == []
