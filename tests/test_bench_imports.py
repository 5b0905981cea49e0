"""Benchmarks stand on their own: no bench module imports a test helper (tests/ is not shipped
with the benches, and a test refactor must not break them)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
TEST_MODULES = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"tests"}


def test_no_bench_module_imports_from_tests():
    problems = []
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            problems += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                         if n.split(".")[0] in TEST_MODULES]
        # a path to tests/ put on sys.path is the same dependency by another route
        if '"tests"' in path.read_text() or "'tests'" in path.read_text():
            problems.append(f"{path.relative_to(ROOT)} names the tests folder")
    assert not problems, problems
