"""The import rules, read from the source: the engine's layers never import upward, the engine
never imports the app, and the app imports nothing from the engine but its public names; no
import circles inside app/ or engine/, counting the imports inside functions; and few functions
over ruff's complexity limit."""

import ast
import graphlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import engine

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
# Lowest first; a module may import its own layer or lower ones.
LAYERS = [("errors", "events", "paths", "device", "mlx_lm_adapter"),
          ("kernels", "model_cache", "slot_cache"),
          ("loading",), ("decoding",), ("prefix_cache",), ("scheduling",), ("distributed",),
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


def mlx_lm_private_imports() -> list[str]:
    """Imports of mlx-lm's private names (`_name`) outside engine/mlx_lm_adapter.py."""
    problems = []
    for path, package, module in engine_modules():
        if module == "mlx_lm_adapter":
            continue
        for target, names, line in imports(path, package):
            if target.split(".")[0] == "mlx_lm" and any(
                    n.startswith("_") for n in target.split(".")[1:] + names):
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {target} {names}")
    return problems


def test_mlx_lm_private_names_come_through_one_adapter(tmp_path, monkeypatch):
    assert mlx_lm_private_imports() == []
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "engine" / "decoding").mkdir(parents=True)
    (tmp_path / "engine" / "mlx_lm_adapter.py").write_text("from mlx_lm.utils import _get_classes\n")
    (tmp_path / "engine" / "decoding" / "x.py").write_text(
        "from mlx_lm.utils import load\ndef f():\n    from mlx_lm.generate import _merge_caches\n")
    assert mlx_lm_private_imports() == [
        "engine/decoding/x.py:3 imports mlx_lm.generate ['_merge_caches']"]


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


# --- no import circles ---------------------------------------------------------------------------

def _running_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import that runs: at the module's import or when a function or method of it runs
    (an import inside a function only hides a circle until that function is called). The
    `if TYPE_CHECKING:` blocks are left out: they never run."""
    out, pending = [], list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        pending += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return out


def import_graph(top: str) -> dict[str, set[str]]:
    """Each module of package `top` (`app`, `engine`) and the modules of `top` it imports, at its
    own import or inside its functions (`from pkg import name` counts as importing `pkg.name` when
    that is a module)."""
    files = {}
    for path in sorted((ROOT / top).rglob("*.py")):
        parts = [top, *path.relative_to(ROOT / top).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        files[module] = (path, module if is_package else ".".join(parts[:-1]))
    graph: dict[str, set[str]] = {}
    for module, (path, package) in files.items():
        edges = graph.setdefault(module, set())
        for node in _running_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in files else base)
        edges &= set(files) - {module}
    return graph


def import_circle(top: str) -> list[str] | None:
    """One import circle among `top`'s modules (the modules in order), or None."""
    try:
        graphlib.TopologicalSorter(import_graph(top)).prepare()
    except graphlib.CycleError as exc:
        return exc.args[1]
    return None


@pytest.mark.parametrize("top", ["app", "engine"])
def test_no_import_circles(top):
    assert import_circle(top) is None


def test_the_circle_check_finds_a_circle(tmp_path, monkeypatch):
    """A circle closed by an import inside a function (or a method) is a circle; one that only
    type annotations close (`if TYPE_CHECKING:`) is not."""
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "app" / "ui").mkdir(parents=True)
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "ui" / "__init__.py").write_text("from . import views\n")
    (tmp_path / "app" / "ui" / "picker.py").write_text("import json\nfrom .views import f\n")
    (tmp_path / "app" / "ui" / "views.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .picker import x\n")
    assert import_circle("app") is None
    (tmp_path / "app" / "ui" / "views.py").write_text(
        "class V:\n    def f(self):\n        if self:\n            from .picker import x\n")
    assert sorted(set(import_circle("app"))) == ["app.ui.picker", "app.ui.views"]
    (tmp_path / "app" / "ui" / "views.py").write_text("from app.ui import picker\n")
    assert sorted(set(import_circle("app"))) == ["app.ui.picker", "app.ui.views"]


# --- complexity -----------------------------------------------------------------------------------

# Functions over ruff's C901 limit (max-complexity 10) allowed in engine/ and app/ together.
MAX_COMPLEX_FUNCTIONS = 2


def complex_functions(*folders: str) -> list[str]:
    """`path:line name (complexity)` for each function over the C901 limit, as ruff finds them."""
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "C901", "--config",
                          "lint.mccabe.max-complexity=10", "--output-format", "json", "--no-cache",
                          "--exit-zero", *folders], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return [f"{Path(f['filename']).relative_to(ROOT)}:{f['location']['row']} {f['message']}"
            for f in json.loads(run.stdout)]


def test_few_functions_are_too_complex():
    found = complex_functions("engine", "app")
    assert len(found) <= MAX_COMPLEX_FUNCTIONS, "\n".join(found)


def test_the_complexity_check_counts_what_ruff_finds(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "app").mkdir()
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(11))
    (tmp_path / "app" / "a.py").write_text(f"def tangled(x):\n{branches}    return -1\n"
                                          "def plain(x):\n    return x\n")
    assert complex_functions("app") == ["app/a.py:1 `tangled` is too complex (12 > 10)"]
