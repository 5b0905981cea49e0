"""Per-model settings that always apply, whichever way the model loads (at start, by a request
naming it, after an idle unload or an eviction): sampling defaults or a preset, a shorter context,
the KV cache's format, int8 activations on our CPU kernels, a speculative draft and how long it
stays loaded when idle.

They live in `models.json` in the data folder, beside the conversations database, as

    {"models": {"smollm2-135m-instruct": {"preset": "greedy", "context_length": 4096,
                                          "kv_bits": 8, "int8_activations": true,
                                          "draft": "self-q4", "keep_alive": "10m",
                                          "sampling": {"top_k": 40}}}}

keyed by the name `mlxchat models` lists (or the path a model was loaded from). The file is read
again whenever it changes on disk, so an edit by hand applies at the model's next load; the
Settings page writes it through `ModelSettingsFile.put`. A file that cannot be used is reported
(`error`) and ignored as a whole rather than half applied.
"""

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..decoding.defaults import DEFAULTABLE, KNOWN_FAMILIES, GLOBAL, PRESETS
from ..decoding.sampling import OPTIONS_BY_NAME
from ..errors import InvalidRequest
from ..paths import data_dir
from .keep_alive import keep_alive_seconds

log = logging.getLogger(__name__)

FILE_NAME = "models.json"
KV_BITS = (8, 16)  # 8: the 8-bit KV cache (engine/kernels/kv8.py); 16: the full one
MAX_FILE_BYTES = 256 * 1024


@dataclass(frozen=True)
class ModelSettings:
    """What one model always runs with; None (or empty) leaves each to the model's own files and
    the process's defaults."""

    sampling: Mapping[str, Any] = field(default_factory=dict)  # option -> default value
    preset: str | None = None  # "greedy" or "recommended": the base `sampling` goes over
    context_length: int | None = None  # at most this many tokens (prompt and answer)
    kv_bits: int | None = None  # KV_BITS; None: the process's default (MLXCHAT_KV_BITS)
    int8_activations: bool | None = None  # on our CPU kernels; None: the process's default
    draft: str | None = None  # the speculative draft requests use unless they choose
    keep_alive: float | None = None  # seconds loaded when idle; None: the server's default
    keep_forever: bool = False  # keep_alive was negative: never unloaded when idle

    @classmethod
    def parse(cls, raw: Any, where: str = "settings") -> "ModelSettings":
        """From a JSON object; raises InvalidRequest naming the bad field (`where.field`)."""
        if not isinstance(raw, dict):
            raise InvalidRequest(f"{where} must be an object", field=where, code="invalid_type")
        unknown = set(raw) - set(_PARSERS)
        if unknown:
            raise InvalidRequest(f"{where} has unknown settings: {', '.join(sorted(unknown))}",
                                 field=f"{where}.{sorted(unknown)[0]}", code="unknown_field")
        out: dict[str, Any] = {}
        for name, value in raw.items():
            if value is not None:
                out.update(_PARSERS[name](value, f"{where}.{name}"))
        return cls(**out)

    def as_json(self) -> dict[str, Any]:
        """The settings as the file holds them (unset ones left out)."""
        out = {k: v for k, v in asdict(self).items()
               if v is not None and v != {} and k not in ("keep_forever", "keep_alive")}
        if self.keep_forever:
            out["keep_alive"] = -1
        elif self.keep_alive is not None:
            out["keep_alive"] = self.keep_alive
        return out

    def sampling_defaults(self, family: str | None) -> dict[str, Any]:
        """The sampling defaults these settings give (the preset's, then `sampling` over it);
        engine/decoding/defaults.py puts them above the model's own files."""
        base: dict[str, Any] = {}
        if self.preset == "greedy":
            base = {"temperature": 0.0}
        elif self.preset == "recommended":
            base = dict(KNOWN_FAMILIES.get(family or "", GLOBAL))
        return {**base, **self.sampling}

    def idle_keep(self, default: float | None) -> float | None:
        """Seconds the model stays loaded when idle (None: always), `default` unless set here."""
        if self.keep_forever:
            return None
        return self.keep_alive if self.keep_alive is not None else default


NONE = ModelSettings()


def _invalid(where: str, what: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"{where} must be {what}", field=where, code=code)


def _preset(value: Any, where: str) -> dict[str, Any]:
    if value not in PRESETS:
        raise _invalid(where, f"one of {', '.join(PRESETS)}")
    return {"preset": value}


def _context_length(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16:
        raise _invalid(where, "an integer of at least 16")
    return {"context_length": value}


def _kv_bits(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, bool) or value not in KV_BITS:
        raise _invalid(where, "8 (the 8-bit KV cache) or 16 (the full one)")
    return {"kv_bits": value}


def _int8(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise _invalid(where, "true or false", "invalid_type")
    return {"int8_activations": value}


def _draft(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, str) or not value.strip():
        raise _invalid(where, "a draft's name (self-q4, truncated:N, mtp or a model)")
    return {"draft": value.strip()}


def _keep_alive(value: Any, where: str) -> dict[str, Any]:
    try:
        seconds = keep_alive_seconds(value)
    except InvalidRequest as exc:
        raise InvalidRequest(str(exc), field=where, code="invalid_value") from None
    return {"keep_alive": seconds, "keep_forever": seconds is None}




def _sampling(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{where} must be an object of sampling options", field=where,
                             code="invalid_type")
    out = {}
    for name, value in raw.items():
        if name not in DEFAULTABLE:
            raise InvalidRequest(f"{where}.{name} is not a sampling option a model's defaults "
                                 f"may set ({', '.join(DEFAULTABLE)})", field=f"{where}.{name}",
                                 code="unknown_field")
        try:
            OPTIONS_BY_NAME[name].check(value)
        except InvalidRequest as exc:
            raise InvalidRequest(str(exc), field=f"{where}.{name}", code=exc.code) from None
        out[name] = value
    return {"sampling": out}


# Each setting's parser: (the file's value, where it is) -> ModelSettings fields.
_PARSERS = {"sampling": _sampling, "preset": _preset, "context_length": _context_length,
            "kv_bits": _kv_bits, "int8_activations": _int8, "draft": _draft,
            "keep_alive": _keep_alive}


class ModelSettingsFile:
    """models.json (see the module's doc): read again when it changes, written whole. Thread-safe."""

    def __init__(self, path: Path | None = None):
        """`path`: the file (None: models.json in the data folder, found when first read)."""
        self._path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._table: dict[str, ModelSettings] = {}
        self.error: str | None = None  # why the file on disk is not used, if it is not

    @property
    def path(self) -> Path:
        if self._path is None:
            self._path = data_dir() / FILE_NAME
        return self._path

    def get(self, *names: str | None) -> ModelSettings:
        """The settings of the first of `names` (a model's name, then how it was asked for) the
        file has; NONE when it has none of them."""
        table = self.all()
        return next((table[n] for n in names if n is not None and n in table), NONE)

    def all(self) -> dict[str, ModelSettings]:
        """Every model's settings, as the file holds them now."""
        with self._lock:
            self._refresh()
            return dict(self._table)

    def put(self, name: str, settings: ModelSettings | None) -> None:
        """Set (None: forget) `name`'s settings and write the file at once (atomically)."""
        with self._lock:
            self._refresh()
            if self.error is not None:
                raise InvalidRequest(f"{self.path} cannot be used ({self.error}); fix or delete "
                                     f"it first", field="settings", code="invalid_file")
            table = dict(self._table)
            if settings is None or settings == NONE:
                table.pop(name, None)
            else:
                table[name] = settings
            body = {"models": {n: s.as_json() for n, s in sorted(table.items())}}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(body, indent=2) + "\n")
            os.replace(tmp, self.path)
            self._table, self._stamp = table, _stamp(self.path)

    def _refresh(self) -> None:
        """Under the lock: read the file again if it changed."""
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return
        self._stamp, self._table, self.error = stamp, {}, None
        if stamp is None:
            return
        try:
            if stamp[1] > MAX_FILE_BYTES:
                raise ValueError(f"over {MAX_FILE_BYTES // 1024} KB")
            body = json.loads(self.path.read_text())
            models = body.get("models") if isinstance(body, dict) else None
            if not isinstance(models, dict):
                raise ValueError('it must hold {"models": {"<model>": {...}}}')
            self._table = {str(n): ModelSettings.parse(s, f"models.{n}") for n, s in models.items()}
        except (OSError, ValueError, InvalidRequest) as exc:
            self.error = str(exc)
            log.warning("ignoring %s: %s", self.path, exc)


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
