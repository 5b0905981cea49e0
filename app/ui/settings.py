"""A conversation's settings: presets, the settings panel's form, and the sampling and speculative
options a turn runs with.

A conversation's settings are `{"preset": ..., "sampling": {...}, "system_prompt": ...,
"speculative": None | {"draft": ...}}`; `sampling` holds the `SamplingParams` fields the user set
(the others take the model's defaults, engine.ModelDefaults) and is validated by `SamplingParams`; `speculative` opts the conversation in to speculative decoding (off unless
turned on).
"""

from typing import Any, Mapping

from engine import (SAMPLING_OPTIONS, InvalidRequest, ModelDefaults, SamplingOption,
                    SamplingParams, SpeculativeOptions)


# Form fields of the settings panel, one per sampling option. Blank means the default.
SAMPLING_FIELDS: dict[str, SamplingOption] = {o.name: o for o in SAMPLING_OPTIONS}


def preset_settings(name: str, system_prompt: str = "") -> dict[str, Any]:
    """`recommended`: every sampling value from the model's defaults; `greedy`: temperature 0."""
    sampling: dict[str, Any] = {"temperature": 0.0} if name == "greedy" else {}
    return {"preset": name, "sampling": sampling, "system_prompt": system_prompt}


def sampling_params(settings: Mapping[str, Any], defaults: ModelDefaults | None) -> SamplingParams:
    """The conversation's own values over the model's defaults."""
    sampling = settings.get("sampling", {})
    return defaults.params(sampling) if defaults is not None else SamplingParams(**sampling)


def default_sources(settings: Mapping[str, Any], defaults: ModelDefaults | None) -> dict[str, str]:
    """What the settings panel says under each field: where its value comes from."""
    if defaults is None:
        return {}
    own = settings.get("sampling", {})
    out = {}
    for name, d in defaults.values.items():
        if own.get(name) is not None:
            out[name] = f"this conversation's setting (model default: {_shown(d.value)}, {d.source_text})"
        else:
            out[name] = f"{_shown(d.value)}: {d.source_text}"
    return out


def _shown(value: Any) -> str:
    return "random" if value is None else str(value)


def speculative_options(settings: Mapping[str, Any]) -> SpeculativeOptions | None:
    """The conversation's speculative decoding opt-in, or None (plain decoding)."""
    chosen = settings.get("speculative")
    return SpeculativeOptions(**chosen) if chosen else None


def speculative_form(form: Mapping[str, str]) -> tuple[dict[str, Any] | None, str | None]:
    """The panel's "Speculative decoding" toggle and draft choice: (setting, error message)."""
    if form.get("speculative") != "on":
        return None, None
    draft = (form.get("draft") or "").strip()
    try:
        SpeculativeOptions(draft)
    except InvalidRequest:
        return None, "Choose a draft for speculative decoding."
    return {"draft": draft}, None


def parse_settings_form(form: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Settings from the panel's form, and an error message per field that is wrong."""
    errors: dict[str, str] = {}
    sampling: dict[str, Any] = {}
    for name, option in SAMPLING_FIELDS.items():
        raw = (form.get(name) or "").strip()
        if not raw:
            continue
        try:
            sampling[name] = option.kind(raw)
        except ValueError:
            kind = "a whole number" if option.kind is int else "a number"
            errors[name] = f"{option.label} must be {kind}."
    if not errors:
        try:
            SamplingParams(**sampling)
        except InvalidRequest as exc:
            errors[exc.field if exc.field in SAMPLING_FIELDS else "form"] = str(exc)
    speculative, error = speculative_form(form)
    if error:
        errors["draft"] = error
    settings = {"preset": "custom", "sampling": sampling,
                "system_prompt": (form.get("system_prompt") or "").strip(), "speculative": speculative}
    return settings, errors
