"""Tool calling, OpenAI-style: the request's tools reach the model, its calls come back parsed, and
calls that must be made are valid by construction.

- Prompt: tools go through the chat template (`tools=`) when the template uses them; otherwise a
  system message lists them and asks for `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (`FALLBACK_INSTRUCTIONS`). Earlier calls and `tool` results in the history are passed to a
  tool-aware template as they are, and written in that same fallback form for the others.
- `tool_choice` "required" or a named function: the whole answer is decoded under an llguidance
  grammar (as JSON mode is) that admits only `{"name": <an offered function>, "arguments": <JSON
  matching its parameters schema>}`, so even a small model returns a valid call. With "required"
  and `parallel_tool_calls` (the default) the grammar admits a JSON array of one or more such
  calls; a named function, or `parallel_tool_calls: false`, is one call. As OpenAI does, a named
  call ends with `finish_reason` "stop", a required one with "tool_calls".
- `auto`: free text until the family's tool-call opener (mlx-lm's `TokenizerWrapper` knows it),
  then, for families whose calls are that same JSON object (mlx-lm's `json_tools` format, and the
  fallback), the same grammar for the call (a lazy grammar, as llama.cpp has); with
  `parallel_tool_calls` (the default) the grammar lets the call be closed and another opened,
  else the request ends when the call is complete. Other families' calls are decoded freely and
  parsed by their mlx-lm parser (the first kept without `parallel_tool_calls`).
- `none`: tools are shown to the model but no call is parsed.
"""

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.tool_parsers import json_tools

from ..errors import InvalidRequest
from ..events import ToolCall
from .constrained import JsonConstraint, check_schema, ll_tokenizer

FALLBACK_OPEN, FALLBACK_CLOSE = json_tools.tool_call_start, json_tools.tool_call_end
FALLBACK_INSTRUCTIONS = (
    "You can call these functions (JSON Schema of their arguments given):\n{tools}\n"
    "To call one, answer with only " + FALLBACK_OPEN
    + '{{"name": <function name>, "arguments": <arguments object>}}' + FALLBACK_CLOSE + "."
)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Most functions one request may offer (each schema is compiled to a grammar: ~2-7 ms apiece here,
# once: compiled grammars are kept by the schema's hash, engine/decoding/constrained.py).
MAX_TOOLS = 1_000
# The most time compiling one request's new tool schemas may take (each compile is bounded by the
# grammar engine's own limits; this bounds their sum).
COMPILE_BUDGET_S = 10.0
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools (OpenAI `tools` entries, validated) and how they may be used: `choice`
    is "auto", "none", "required" or "named" (then `name` is the function to call)."""

    tools: tuple[dict[str, Any], ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The answer must be a call (decoded entirely under the call grammar)."""
        return self.choice in ("required", "named")

    @property
    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]


def _invalid(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, field=field, code="invalid_value")


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
        raise _invalid(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    fn = tool.get("function")
    if not isinstance(fn, dict) or set(fn) - {"name", "description", "parameters", "strict"}:
        raise _invalid(f"{where}.function must be an object with 'name' and optionally "
                       "'description', 'parameters' and 'strict'", f"{where}.function")
    if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
        raise _invalid(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got "
                       f"{json.dumps(fn.get('name'))}", f"{where}.function.name")
    if not isinstance(fn.get("description", ""), str):
        raise _invalid(f"{where}.function.description must be a string", f"{where}.function.description")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise _invalid(f"{where}.function.parameters must be a JSON Schema of an object",
                       f"{where}.function.parameters")
    try:
        check_schema(params)
    except InvalidRequest as exc:
        raise _invalid(f"{where}.function.parameters cannot be enforced: "
                       f"{str(exc).removeprefix('json_schema ')}", f"{where}.function.parameters") from None
    return {"type": "function", "function": {**fn, "parameters": params}}


def _check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Each tool checked and its schema compiled, within COMPILE_BUDGET_S in all."""
    deadline = time.monotonic() + COMPILE_BUDGET_S
    checked = []
    for i, tool in enumerate(tools):
        checked.append(_check_tool(i, tool))
        if time.monotonic() > deadline:
            raise _invalid(f"'tools' took more than {COMPILE_BUDGET_S:.0f} s to compile "
                           f"({i + 1} of {len(tools)} schemas): offer fewer or simpler tools",
                           "tools")
    return checked


def tool_request(tools: Any, tool_choice: Any = None, parallel: bool | None = None) -> ToolRequest | None:
    """Validate OpenAI's `tools` (at most MAX_TOOLS), `tool_choice` and `parallel_tool_calls`;
    raises InvalidRequest with the offending field. None: no tools offered. CPU-bound (every
    schema is compiled): call it off the event loop."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise _invalid("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise _invalid("'tools' must be a non-empty array of functions", "tools")
    if len(tools) > MAX_TOOLS:
        raise _invalid(f"'tools' may offer at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    checked = _check_tools(tools)
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise _invalid("'tools' names each function once", "tools")
    choice, name = tool_choice if tool_choice is not None else "auto", None
    if isinstance(choice, dict):
        fn = choice.get("function")
        if (choice.get("type") != "function" or set(choice) - {"type", "function"}
                or not isinstance(fn, dict) or set(fn) != {"name"}):
            raise _invalid('\'tool_choice\' must be "auto", "none", "required" or {"type": '
                           '"function", "function": {"name": ...}}', "tool_choice")
        if fn["name"] not in names:
            raise _invalid(f"'tool_choice' names {json.dumps(fn['name'])}, which is not in 'tools'",
                           "tool_choice")
        choice, name = "named", fn["name"]
    elif choice not in CHOICES:
        raise _invalid('\'tool_choice\' must be "auto", "none", "required" or {"type": '
                       f'"function", "function": {{"name": ...}}}}, got {json.dumps(choice)}',
                       "tool_choice")
    return ToolRequest(tuple(checked), choice, name, True if parallel is None else parallel)


# --- the prompt -----------------------------------------------------------------------------------

def template_uses_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return not isinstance(template, str) or "tools" in template


def _arguments(call: dict[str, Any]) -> Any:
    """A history call's arguments as an object (templates serialise them themselves)."""
    args = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


def _fallback_call(call: dict[str, Any]) -> str:
    body = {"name": call.get("function", {}).get("name"), "arguments": _arguments(call)}
    return FALLBACK_OPEN + json.dumps(body, ensure_ascii=False) + FALLBACK_CLOSE


def prepare(tokenizer: Any, messages: Sequence[dict[str, Any]],
            tools: ToolRequest | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages and template arguments that carry the tools and the tool history to the model."""
    native = template_uses_tools(tokenizer)
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if native:
            m = dict(m)
            if calls:
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c)}}
                                   for c in calls]
                m["content"] = m.get("content") or ""
            out.append(m)
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            content = m.get("content") or ""
            if calls:  # (content with image parts is a list: engine/decoding/vision.py)
                content = content + "".join(_fallback_call(c) for c in calls)
            out.append({"role": m["role"], "content": content})
    if tools is None:
        return out, {}
    if native:
        return out, {"tools": list(tools.tools)}
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.functions)
    system = FALLBACK_INSTRUCTIONS.format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


# --- decoding -------------------------------------------------------------------------------------

def _rooted(schema: Any, base: str) -> Any:
    """`schema` with each local `$ref` ("#", "#/$defs/x", "#/properties/y") rewritten to point
    under `base` (a JSON pointer), where the schema now sits."""
    if isinstance(schema, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                else _rooted(v, base) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rooted(v, base) for v in schema]
    return schema


def _has_ref(schema: Any) -> bool:
    return '"$ref"' in json.dumps(schema)


def call_schema(tools: ToolRequest) -> dict[str, Any]:
    """The JSON Schema of one call to an allowed function. A function's parameters that use local
    `$ref`s (`$defs`, as pydantic writes them, or `#` itself) move to the root's `$defs` under the
    function's name, their references rewritten, so they resolve inside the combined schema."""
    allowed = [f for f in tools.functions if tools.name in (None, f["name"])]
    defs: dict[str, Any] = {}
    options = []
    for f in allowed:
        arguments = f["parameters"]
        if _has_ref(arguments):
            defs[f["name"]] = _rooted(arguments, f"#/$defs/{f['name']}")
            arguments = {"$ref": f"#/$defs/{f['name']}"}
        options.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                         "arguments": arguments},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


def forced_schema(tools: ToolRequest) -> dict[str, Any]:
    """What a forced answer must be: one call, or a list of calls where several are allowed."""
    if tools.choice == "required" and tools.parallel:
        call = call_schema(tools)
        defs = call.pop("$defs", None)
        return {"type": "array", "items": call, "minItems": 1, **({"$defs": defs} if defs else {})}
    return call_schema(tools)


def _tools_grammar(schema: dict[str, Any]) -> str:
    """The grammar of the calls' schema; refused naming `tools` (not the JSON mode's field)."""
    try:
        return check_schema(schema)
    except InvalidRequest as exc:
        raise _invalid(f"'tools' cannot be enforced together: "
                       f"{str(exc).removeprefix('json_schema is not a supported JSON Schema: ')}; "
                       "offer fewer or smaller tools", "tools") from None


def markers(tokenizer: Any) -> tuple[str, str]:
    """The family's (opener, closer) of a tool call, or the fallback's."""
    if getattr(tokenizer, "has_tool_calling", False):
        return tokenizer.tool_call_start, tokenizer.tool_call_end
    return FALLBACK_OPEN, FALLBACK_CLOSE


def _parser(tokenizer: Any) -> Any:
    return tokenizer.tool_parser if getattr(tokenizer, "has_tool_calling", False) else \
        json_tools.parse_tool_call


def json_calls(tokenizer: Any) -> bool:
    """Whether the family writes a call as the JSON object `call_schema` describes."""
    return _parser(tokenizer) is json_tools.parse_tool_call


def _marker_term(tokenizer: Any, marker: str) -> str:
    """A marker in llguidance's Lark: its added token (by id) where it is one, else its text."""
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) == 1 and ll_tokenizer(tokenizer).is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(marker)


def calls_grammar(tokenizer: Any, tools: ToolRequest) -> str:
    """The grammar after the opener in `auto`: one call; with `parallel_tool_calls`, further calls
    each closed and the next opened (`</tool_call>`, an optional newline, `<tool_call>`) before
    the answer ends."""
    schema = call_schema(tools)
    grammar = _tools_grammar(schema)
    opener, closer = markers(tokenizer)
    if not (tools.parallel and closer):
        return grammar
    from llguidance import LLMatcher

    sep = f'{_marker_term(tokenizer, closer)} "\\n"? {_marker_term(tokenizer, opener)}'
    body = json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})
    return LLMatcher.grammar_from_lark(f"%llguidance {{}}\nstart: call ({sep} call)* "
                                       f"{_marker_term(tokenizer, closer)}?\ncall: %json {body}\n")


class LazyCallConstraint:
    """A logits processor that lets the model write freely until its text ends in the tool-call
    opener, then constrains the calls to `calls_grammar` (see the module docstring)."""

    def __init__(self, tokenizer: Any, grammar: str, prompt_length: int):
        self.tokenizer = tokenizer
        self.opener = markers(tokenizer)[0]
        self.grammar = grammar
        self.prompt_length = prompt_length
        self.inner: JsonConstraint | None = None

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if self.inner is None:
            generated = history[self.prompt_length:].tolist()
            if not generated or not self.tokenizer.decode(generated[-8:]).endswith(self.opener):
                return logits
            self.inner = JsonConstraint(ll_tokenizer(self.tokenizer), self.grammar, history.shape[0])
        return self.inner(history, logits)


def constraint(tokenizer: Any, tools: ToolRequest, prompt_length: int) -> Any:
    """The logits processor that keeps this request's calls valid, or None (calls unconstrained)."""
    if tools.forced:
        return JsonConstraint(ll_tokenizer(tokenizer), _tools_grammar(forced_schema(tools)),
                              prompt_length)
    if tools.choice == "auto" and json_calls(tokenizer):
        return LazyCallConstraint(tokenizer, calls_grammar(tokenizer, tools), prompt_length)
    return None


# --- parsing --------------------------------------------------------------------------------------

def _call(parsed: dict[str, Any]) -> ToolCall:
    args = parsed.get("arguments", {})
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=str(parsed["name"]),
                    arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_calls(tokenizer: Any, tools: ToolRequest, text: str) -> list[ToolCall]:
    """The calls in the tool channel's text (for `auto`, it starts with the opener): all of them,
    or the first without `parallel_tool_calls`; a last call cut off (by max_tokens) is left out.
    Raises ValueError when the text holds no complete call."""
    if tools.forced:
        parsed = json.loads(text)
        return [_call(one) for one in (parsed if isinstance(parsed, list) else [parsed])]
    opener, closer = markers(tokenizer)
    parser = _parser(tokenizer)
    calls = []
    parts = text.split(opener)[1:]
    for i, part in enumerate(parts):
        body = part.split(closer)[0] if closer else part
        try:
            parsed = parser(body, list(tools.tools))
        except Exception:  # noqa: BLE001 - the family's parser raises what it raises
            if calls and i == len(parts) - 1 and not (closer and closer in part):
                break  # the last call, unfinished
            raise
        for one in parsed if isinstance(parsed, list) else [parsed]:
            calls.append(_call(one))
    if not calls:
        raise ValueError("no tool call in the answer")
    return calls if tools.parallel else calls[:1]
