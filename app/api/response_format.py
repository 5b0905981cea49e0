"""OpenAI's `response_format` as the JSON Schema the answer must match (JSON mode), refusing a
schema whose `$ref`s loop on the same value (the grammar engine could not compile it)."""

import json
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
    loop = _ref_loop(spec["schema"])
    if loop is not None:
        raise ApiError(400, f"'response_format.json_schema.schema' refers to itself through "
                            f"{json.dumps(loop)}: no JSON value can match it", "response_format",
                       "invalid_value")
    return spec["schema"]


# Keywords whose subschemas apply to the same JSON value as their parent: a `$ref` cycle through
# them alone never reaches a value (properties/items descend into one, so recursion there is fine).
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else")


def _resolve(schema: dict[str, Any], ref: str) -> Any:
    """The subschema a local `$ref` points to (None: not local or not there)."""
    if not ref.startswith("#"):
        return None
    node: Any = schema
    for part in filter(None, ref[1:].split("/")):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _same_value(schema: dict[str, Any], node: dict[str, Any]) -> list[tuple[Any, str | None]]:
    """The subschemas `node` applies to its own value, each with the `$ref` leading there."""
    found: list[tuple[Any, str | None]] = []
    if isinstance(node.get("$ref"), str):
        found.append((_resolve(schema, node["$ref"]), node["$ref"]))
    for key in _IN_PLACE:
        value = node.get(key)
        found.extend((sub, None) for sub in (value if isinstance(value, list) else [value]))
    return [(sub, ref) for sub, ref in found if isinstance(sub, dict)]


def _ref_loop(schema: dict[str, Any]) -> str | None:
    """A local `$ref` that comes back to itself on the same JSON value (`{"$ref": "#"}`, `a`
    defined as `{"$ref": "#/definitions/a"}` or as `{"allOf": [{"$ref": "#/definitions/a"}]}`):
    the grammar engine cannot compile it and would only fail while generating."""
    done: set[int] = set()
    pending: list[Any] = [schema]
    while pending:  # every subschema, each the start of a walk along same-value edges
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        pending.extend(node.values())
        if id(node) in done:
            continue
        path, on_path = [(node, iter(_same_value(schema, node)))], {id(node)}
        while path:  # depth first; a node met again on the current path closes a loop
            top, edges = path[-1]
            step = next(edges, None)
            if step is None:
                path.pop()
                on_path.discard(id(top))
                done.add(id(top))
                continue
            sub, ref = step
            if id(sub) in on_path:
                return ref or "$ref"  # only a `$ref` can lead back up
            if id(sub) not in done:
                path.append((sub, iter(_same_value(schema, sub))))
                on_path.add(id(sub))
    return None
