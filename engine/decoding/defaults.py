"""Per-model sampling defaults, each with where it came from.

One value per sampling option, from the first layer that has it:
  the model's settings (models.json, engine/scheduling/model_settings.py) > the model's own files (`generation_config.json` of an mlx-lm folder, or a GGUF's
  `general.sampling.*` keys) > mlxchat's table of known models > mlxchat's global default.
A conversation's own settings and a request's explicit fields sit above all of these (`params`).

Temperature 0 means plain greedy decoding: penalties that only came from defaults are dropped, so greedy output stays identical to mlx-lm's unless a penalty was asked for.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import InvalidRequest
from ..loading.gguf import source_gguf
from ..loading.gguf_metadata import scalar_metadata
from .sampling import OPTIONS_BY_NAME, SAMPLING_OPTIONS, SamplingParams

log = logging.getLogger(__name__)

# How the settings panel names each source.
SOURCES = {
    "explicit": "set here",
    "settings": "from this model's settings",
    "generation_config": "from the model's generation_config.json",
    "gguf": "from the model's GGUF metadata",
    "table": "mlxchat's preset for this model",
    "global": "mlxchat's default",
}
PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")

# Known models, matched by a lower-case fragment of their name; the first match wins.
KNOWN_MODELS: tuple[tuple[str, dict[str, Any]], ...] = (
    # SmolLM2's card suggests a low temperature; without a repetition penalty it loops often.
    ("smollm2", dict(temperature=0.2, top_p=0.9, repetition_penalty=1.1,
                     repetition_context_size=64)),
)
# Model families' recommended non-thinking settings (from their model cards), after the names.
KNOWN_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0),
    "qwen3_5": dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0),
    "qwen3_next": dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0),
    "qwen2": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
}
# The global layer: sampling on, the rest as each option declares.
GLOBAL = {"temperature": 0.7, "top_p": 0.9}

# The presets `preset` gives by name (`mlxchat chat --preset`, the settings panel).
PRESETS = ("greedy", "recommended")


def preset(name: str, family: str | None = None, **overrides: Any) -> SamplingParams:
    """`greedy`, or `recommended` by model family alone (e.g. the `model_type` of its config);
    a loaded model's own defaults are `Engine.defaults` (`resolve_defaults` below)."""
    if name == "greedy":
        base: dict[str, Any] = {}
    elif name == "recommended":
        base = dict(KNOWN_FAMILIES.get(family or "", GLOBAL))
    else:
        raise InvalidRequest(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})",
                             field="preset", code="invalid_value")
    base.update(overrides)
    return SamplingParams(**base)


# generation_config.json key -> option; GGUF `general.sampling.<key>` -> option.
_GENERATION_CONFIG = {k: k for k in ("temperature", "top_p", "top_k", "min_p",
                                     "repetition_penalty")}
_GGUF = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "penalty_repeat": "repetition_penalty", "penalty_last_n": "repetition_context_size"}
# Options a model's defaults may set (max_tokens and seed are the user's).
DEFAULTABLE = tuple(o.name for o in SAMPLING_OPTIONS if o.name not in ("max_tokens", "seed"))


@dataclass(frozen=True)
class Default:
    value: int | float | None
    source: str  # a key of SOURCES

    @property
    def source_text(self) -> str:
        return SOURCES[self.source]


@dataclass(frozen=True)
class ModelDefaults:
    """Every sampling option's default for one model, with its source."""

    values: Mapping[str, Default]

    def __getitem__(self, name: str) -> Default:
        return self.values[name]

    def params(self, explicit: Mapping[str, Any] | None = None) -> SamplingParams:
        """SamplingParams from `explicit` values (a request's fields, a conversation's settings),
        each missing option from these defaults; raises InvalidRequest for bad explicit values."""
        explicit = {k: v for k, v in (explicit or {}).items() if v is not None or k == "seed"}
        values = {name: d.value for name, d in self.values.items()}
        values.update(explicit)
        if values["temperature"] == 0:  # plain greedy unless a penalty is asked for
            for name in PENALTIES:
                if name not in explicit:
                    values[name] = OPTIONS_BY_NAME[name].default
        return SamplingParams(**values)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {name: {"value": d.value, "source": d.source} for name, d in self.values.items()}


def _valid(name: str, value: Any) -> Any:
    """`value` coerced to the option's kind if it is allowed there, else None."""
    option = OPTIONS_BY_NAME[name]
    if option.kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if option.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    try:
        option.check(value)
    except InvalidRequest:
        return None
    return value


def generation_config_values(folder: Path) -> dict[str, Any]:
    """Sampling values from a model folder's generation_config.json (do_sample false: greedy)."""
    try:
        config = json.loads((Path(folder) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    found = {option: config[key] for key, option in _GENERATION_CONFIG.items() if key in config}
    if config.get("do_sample") is False:
        found = {"temperature": 0.0}
    return found


def gguf_sampling_values(gguf: Path) -> dict[str, Any]:
    """Sampling values from a GGUF's `general.sampling.*` metadata keys, as llama.cpp reads them."""
    metadata = scalar_metadata(gguf)
    return {option: metadata[f"general.sampling.{key}"] for key, option in _GGUF.items()
            if f"general.sampling.{key}" in metadata}


def table_values(name: str, family: str | None) -> dict[str, Any]:
    """mlxchat's preset for a model: by its name first, then by its family."""
    lowered = name.lower()
    for fragment, values in KNOWN_MODELS:
        if fragment in lowered:
            return dict(values)
    return dict(KNOWN_FAMILIES.get(family or "", {}))


def resolve_defaults(name: str, folder: Path | None, family: str | None,
                     settings: Mapping[str, Any] | None = None) -> ModelDefaults:
    """The defaults of the model called `name` whose mlx-lm folder is `folder`; `settings`: the
    values its own settings declare, over everything else."""
    layers: list[tuple[str, dict[str, Any]]] = [("settings", dict(settings or {}))]
    if folder is not None:
        layers.append(("generation_config", generation_config_values(folder)))
        gguf = source_gguf(folder)
        if gguf is not None:
            layers.append(("gguf", gguf_sampling_values(gguf)))
    layers += [("table", table_values(name, family)), ("global", GLOBAL)]
    values = {}
    for option in DEFAULTABLE:
        chosen = Default(OPTIONS_BY_NAME[option].default, "global")
        for source, found in layers:
            if option in found:
                value = _valid(option, found[option])
                if value is not None:
                    chosen = Default(value, source)
                    break
                log.warning("ignoring %s=%r from %s of %s: out of range", option, found[option],
                            source, name)
        values[option] = chosen
    for option in ("max_tokens", "seed"):
        values[option] = Default(OPTIONS_BY_NAME[option].default, "global")
    return ModelDefaults(values)
