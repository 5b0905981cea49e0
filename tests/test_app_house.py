"""The app's house rules, read from the source: few modules at app/'s top (the rest in wings), the
shared state one typed `AppState` read through `app_state` (nobody reaches into the app's state
bag), and no `Any` standing for the engine, the storage, the state, a request or its handle."""

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from app.state import AppState

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
MAX_TOP_MODULES = 10
# Parameters by these names hold the engine, the storage, the app or its state, a request or its
# handle: they are typed with what they hold.
TYPED_NAMES = {"engine", "storage", "app", "state", "request", "ws", "handle", "handles", "store",
               "conv"}


def top_modules(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "app").glob("*.py") if p.name != "__init__.py")


def untyped_holders(root: Path) -> list[str]:
    """`path:line function(param)` for each parameter in TYPED_NAMES annotated `Any` or not at all
    (`self`, `cls` and lambdas aside)."""
    found = []
    for path in sorted((root / "app").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            for a in args.posonlyargs + args.args + args.kwonlyargs:
                if a.arg in TYPED_NAMES and (a.annotation is None or ast.unparse(a.annotation) == "Any"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}({a.arg})")
    return found


def state_bag_reads(root: Path) -> list[str]:
    """`path:line` for each `<x>.app.state` outside app/state.py: routes read `app_state(x)`."""
    found = []
    for path in sorted((root / "app").rglob("*.py")):
        if path.relative_to(root).as_posix() == "app/state.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "state" and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "app":
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_app_top_level_holds_few_modules():
    assert len(top_modules(ROOT)) <= MAX_TOP_MODULES, top_modules(ROOT)


def test_no_any_for_the_engine_the_storage_the_state_or_a_request():
    assert untyped_holders(ROOT) == []


def test_routes_read_the_state_through_its_accessor():
    assert state_bag_reads(ROOT) == []


def test_the_state_is_typed_field_by_field():
    hints = typing.get_type_hints(AppState)
    assert {f.name for f in dataclasses.fields(AppState)} <= set(hints)
    assert all(hint is not typing.Any for hint in hints.values()), hints


def test_the_checks_catch_what_they_look_for(tmp_path):
    (tmp_path / "app" / "ui").mkdir(parents=True)
    for i in range(MAX_TOP_MODULES + 1):
        (tmp_path / "app" / f"m{i}.py").write_text("")
    (tmp_path / "app" / "ui" / "page.py").write_text(
        "from typing import Any\n"
        "def view(request, engine: Any, n: Any) -> None:\n"
        "    return request.app.state.storage\n")
    assert len(top_modules(tmp_path)) == MAX_TOP_MODULES + 1
    assert untyped_holders(tmp_path) == ["app/ui/page.py:2 view(request)",
                                         "app/ui/page.py:2 view(engine)"]
    assert state_bag_reads(tmp_path) == ["app/ui/page.py:3"]
