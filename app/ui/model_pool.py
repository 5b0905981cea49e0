"""The model panel's part about the engine's model pool (issue 49): the models in memory (their
weights, and when each leaves memory if still idle) and the settings of the picked model that
always apply to it (engine.ModelSettings, kept in models.json beside the database), which the
panel edits; a model in memory that is idle leaves it when its settings change, so that its next
request loads it as they say."""

import time
from typing import Any

from engine import PRESETS, Engine, EngineError, ModelSettings, ResidentModel

# The form's fields, as ModelSettings names them (the form's inputs are `model_<field>`, apart
# from the conversation's own settings); blank fields are left unset.
FIELDS = ("preset", "context_length", "kv_bits", "int8_activations", "draft", "keep_alive")


def expiry(m: ResidentModel, now: float | None = None) -> str:
    """When a model in memory leaves it, in words."""
    if m.busy:
        return "in use"
    if m.expires_at is None:
        return "pinned" if m.pinned else "stays loaded"
    left = max(m.expires_at - (now if now is not None else time.time()), 0)
    if left < 90:
        return f"unloads in {left:.0f} s"
    return f"unloads in {left / 60:.0f} min" if left < 5400 else f"unloads in {left / 3600:.0f} h"


def pool_context(engine: Engine, model: str | None) -> dict[str, Any]:
    """What `_model_pool.html` shows: the models in memory and `model`'s settings (its form)."""
    settings = engine.model_settings.get(model) if model else None
    return {"loaded": [(m, expiry(m)) for m in engine.loaded_models()], "settings_model": model,
            "model_settings": settings.as_json() if settings is not None else {},
            "settings_error": engine.model_settings.error, "model_presets": PRESETS}


def parse_form(form: dict[str, str]) -> ModelSettings:
    """The panel's form as ModelSettings; raises EngineError naming the bad field."""
    raw: dict[str, Any] = {}
    for name in FIELDS:
        value = form.get(f"model_{name}", "").strip()
        if not value:
            continue
        if name in ("context_length", "kv_bits"):
            if not value.isdigit():
                raise EngineError(f"{name.replace('_', ' ')} must be a whole number",
                                  field=name)
            raw[name] = int(value)
        elif name == "int8_activations":
            raw[name] = value == "on"
        else:
            raw[name] = value
    return ModelSettings.parse(raw, "settings")


def save_settings(engine: Engine, form: dict[str, str]) -> tuple[str | None, str | None]:
    """Save the form's settings of the model it names: (what to say, or why not). An idle model
    in memory leaves it, so that its next request loads it as they say."""
    name = form.get("name", "")
    if name not in {m.name for m in engine.list_models()}:
        return None, f"Unknown model {name!r}."
    try:
        engine.model_settings.put(name, parse_form(form))
    except EngineError as exc:
        return None, str(exc)
    if name in {m.name for m in engine.loaded_models() if not m.busy}:
        engine.unload_model(name)
        return f"Saved; {name} loads with these settings on its next request.", None
    return f"Saved; {name} loads with these settings.", None
