"""The tiny random-weight model folders the suite builds, built ahead of the tests.

`bench.shapes.build_folder` builds a folder the first time a test asks for its (config, seed) and
reuses it after; on a fresh clone that is ~20 builds inside the fast tier. `.ci/run`'s setup
builds the folders listed in `tiny_recipes.json` first, beside the kernels and the bundled model,
so the tiers time tests rather than model building. A stale entry only costs one unused build;
a missing one is built by its test, as before. Refresh the list from a run's cache:

    python tests/tiny_recipes.py .mlxchat-home/cache/tiny-models      # writes tiny_recipes.json
    python tests/tiny_recipes.py --build                             # what setup runs
"""

import hashlib
import json
import sys
from pathlib import Path

TABLE = Path(__file__).with_name("tiny_recipes.json")


def recipes_in(folder: Path) -> list[dict]:
    """The (config, seed) of every folder `build_folder` made under `folder` (its name is the
    model type and a hash of [config, seed]; the seed is found by matching the hash)."""
    found = []
    for f in sorted(folder.iterdir()):
        model_type, _, key = f.name.rpartition("-")
        if not (f / "config.json").exists() or not model_type or "-" in model_type:
            continue
        config = json.loads((f / "config.json").read_text())
        for seed in range(16):
            if hashlib.sha256(json.dumps([config, seed], sort_keys=True).encode()).hexdigest()[:12] == key:
                found.append({"config": config, "seed": seed})
                break
    return found


def build() -> int:
    """Build every listed folder not built yet (in the cache `MLXCHAT_HOME` names)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.shapes import build_folder

    recipes = json.loads(TABLE.read_text())
    for recipe in recipes:
        build_folder(recipe["config"], recipe["seed"])
    return len(recipes)


if __name__ == "__main__":
    if sys.argv[1:] == ["--build"]:
        print(f"tiny models ready: {build()}")
    else:
        TABLE.write_text(json.dumps(recipes_in(Path(sys.argv[1])), indent=1, sort_keys=True) + "\n")
        print(f"wrote {TABLE}")
