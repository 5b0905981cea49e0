"""OpenAI's `response_format` as the JSON Schema the answer must match (JSON mode); the schema is
compiled, and one the grammar engine could not use refused, by `SamplingParams`
(engine/decoding/constrained.py)."""

from typing import Any

from .errors import ApiError


def json_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON Schema that `response_format` asks the answer to match (None: plain text):
    `{"type": "json_object"}` is any object; `{"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}` is that schema (checked by `SamplingParams`)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind in ("text", "json_object") and len(response_format) == 1:
        return {"type": "object"} if kind == "json_object" else None
    if kind != "json_schema" or set(response_format) != {"type", "json_schema"}:
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": "
                            "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                            "{\"name\": ..., \"schema\": {...}}}", "response_format")
    spec = response_format["json_schema"]
    if (not isinstance(spec, dict) or set(spec) - {"name", "description", "schema", "strict"}
            or not isinstance(spec.get("schema"), dict)
            or not isinstance(spec.get("name", ""), str)
            or not isinstance(spec.get("strict", False), (bool, type(None)))):
        raise ApiError(400, "'response_format.json_schema' must be an object with 'schema' (a JSON "
                            "Schema object) and optionally 'name', 'description' and 'strict'",
                       "response_format")
    return spec["schema"]  # compiled (and a `$ref` loop refused) by SamplingParams
