"""The import rules, read from the source: the engine's layers never import upward, the engine
never imports the app, and the app imports nothing from the engine but its public names."""

import ast
from pathlib import Path

import pytest

import engine

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
# Lowest first; a module may import its own layer or lower ones.
LAYERS = [("errors", "events", "paths", "device"), ("kernels",), ("loading",), ("decoding",),
          ("cache",), ("scheduling",), ("distributed",),
          ("__init__",)]


def layer_of(module: str) -> int:
    """`module` is dotted under engine, e.g. "decoding.drafts" or "__init__"."""
    head = module.split(".")[0]
    return next(i for i, names in enumerate(LAYERS) if head in names)


def imports(path: Path, package: str) -> list[tuple[str, list[str], int]]:
    """(absolute module, names imported from it, line) for each import in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.append((base, [a.name for a in node.names], node.lineno))
    return found


def engine_modules() -> list[tuple[Path, str, str]]:
    """(file, its package, its module path under engine) for every engine source file."""
    out = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT / "engine").with_suffix("")
        parts = list(rel.parts)
        package = ".".join(["engine", *parts[:-1]])
        out.append((path, package, ".".join(parts)))
    return out


def upward_imports() -> list[str]:
    problems = []
    for path, package, module in engine_modules():
        own = layer_of(module)
        for target, names, line in imports(path, package):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if target.split(".")[0] in ("app", "web", "static", "bench", "tests"):
                problems.append(where)
            elif target == "engine":
                targets = [f"engine.{n}" for n in names]  # `from engine import x` / `from . import x`
                for t in targets:
                    sub = t.removeprefix("engine.")
                    if (ROOT / "engine" / sub).exists() or (ROOT / "engine" / f"{sub}.py").exists():
                        if layer_of(sub) > own:
                            problems.append(where + f" ({sub})")
                    else:
                        problems.append(where + f" (the public API, from inside the engine: {sub})")
            elif target.startswith("engine."):
                if layer_of(target.removeprefix("engine.")) > own:
                    problems.append(where)
    return problems


def app_imports() -> list[str]:
    problems = []
    public = set(engine.__all__)
    for path in sorted((ROOT / "app").rglob("*.py")):
        for target, names, line in imports(path, "app"):
            where = f"{path.relative_to(ROOT)}:{line}"
            if target.startswith("engine."):
                problems.append(f"{where} imports {target}")
            elif target == "engine":
                if not names:
                    problems.append(f"{where}: `import engine` (import its public names)")
                problems += [f"{where} imports engine.{n}, not public" for n in names if n not in public]
    return problems


def test_engine_layers_never_import_upward_nor_the_app():
    assert upward_imports() == []


def test_the_app_imports_only_the_engines_public_api():
    assert app_imports() == []


def test_the_checks_catch_what_they_look_for(tmp_path, monkeypatch):
    """Each rule fails on a file that breaks it (written into a scratch copy of the tree)."""
    for name in ("engine", "app"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert upward_imports() == [] and app_imports() == []
    (tmp_path / "engine").unlink()
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "device.py").write_text("from .scheduling.service import Engine\n")
    (tmp_path / "engine" / "events.py").write_text("from app import ui\n")
    (tmp_path / "app").unlink()
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "ui.py").write_text(
        "from engine.decoding.sampling import SamplingParams\nfrom engine import Engine, lm\n")
    assert upward_imports() == ["engine/device.py:1 imports engine.scheduling.service",
                                "engine/events.py:1 imports app"]
    assert app_imports() == ["app/ui.py:1 imports engine.decoding.sampling",
                             "app/ui.py:2 imports engine.lm, not public"]
