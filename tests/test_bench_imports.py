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
    # the bench's own modules, not a virtual environment inside it (bench/setup-llamacpp's)
    for path in sorted(p for p in (ROOT / "bench").rglob("*.py")
                       if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)):
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


def test_a_shape_built_twice_has_the_same_weights():
    """On a GPU the bench runs mlx-lm on its own copy of a shape (ours has the GPU layout), so the
    copies must be the same model, down to the parameters a hybrid draws in its constructor."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from bench.shapes import SHAPES, build_module

    a, b = (tree_flatten(build_module(SHAPES["tiny-hybrid"]).parameters()) for _ in range(2))
    assert [k for k, _ in a] == [k for k, _ in b]
    assert all(mx.array_equal(x, y).item() for (_, x), (_, y) in zip(a, b))
