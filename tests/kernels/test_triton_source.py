"""Rules of Triton's compiler that TRITON_INTERPRET=1 does not enforce, checked on the source so
that CPU CI catches them before a GPU run does."""

import ast
import pathlib

import moeferry

KERNEL_DIR = pathlib.Path(moeferry.__file__).parent


def jit_functions():
    for path in sorted(KERNEL_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                yield path, node


def returns_before_fall_through(fn: ast.FunctionDef):
    """Lines of `if` statements that return from inside, have no else, and are followed by more
    statements: the compiler types the statements after them even when the condition is a
    constexpr that is true, so two returns of different types fail to compile."""
    for node in ast.walk(fn):
        for field in ("body", "orelse"):
            stmts = getattr(node, field, None)
            if not isinstance(stmts, list):
                continue
            for stmt, _ in zip(stmts, stmts[1:]):
                if isinstance(stmt, ast.If) and not stmt.orelse and any(
                        isinstance(inner, ast.Return) and inner.value is not None for inner in ast.walk(stmt)):
                    yield stmt.lineno


def test_the_scan_finds_jit_functions():
    names = {fn.name for _, fn in jit_functions()}
    assert {"_load_b", "_scaled_dot", "_moe_gemm_kernel"} <= names


def test_no_jit_function_returns_a_value_from_an_if_without_else():
    offenders = [f"{path.relative_to(KERNEL_DIR.parent)}:{line} ({fn.name})"
                 for path, fn in jit_functions() for line in returns_before_fall_through(fn)]
    assert not offenders, "give these ifs an else: " + ", ".join(offenders)
