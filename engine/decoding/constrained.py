"""JSON mode: constrained decoding with llguidance, so that the output must parse (and match a JSON
Schema when one is given).

A request's schema is compiled once to an llguidance grammar (`check_schema`, called by
`SamplingParams.validate`), and each distinct schema once per process: grammars are kept by the
schema's sha256, and the matcher built from one (its lexer over the vocabulary) is copied for each
request. A schema the grammar engine would compile but could not use is refused first: a `$ref`
that loops on one value, a `pattern` whose counted repetitions unroll to a huge lexer. Its `JsonConstraint` is a logits processor like mlx-lm's: it is called
as `processor(history, logits)` before sampling, advances its matcher by the tokens that were added
to `history` since its last call (the previously sampled token; nothing on the first call, which
predicts the first answer token from the prompt) and masks every token the grammar forbids to -inf.
Once the JSON value is complete the grammar allows only EOS, so the request stops there.

JSON is compact by default (no whitespace between tokens): a small model allowed free whitespace
can loop on newlines forever. A schema may ask otherwise through llguidance's `x-guidance` options.
An answer cut by `max_tokens` (finish_reason "length") is still unfinished JSON.
"""

import hashlib
import json
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import EngineError, InvalidRequest

# `{"type": "json_object"}` of the OpenAI API: any JSON object.
_OPTIONS = {"whitespace_flexible": False}
# Compiled grammars kept by the sha256 of their schema (agents send the same tools every turn),
# at most this many bytes of grammar text in all; the least recently used go first.
GRAMMAR_CACHE_BYTES = 64 * 1024 * 1024
# A `pattern` whose repetitions unroll to more than this many pieces (`a{1000}{1000}`: a million)
# is refused: the grammar engine builds its lexer lazily, so such a pattern compiles at once and
# then fails, or crawls, token by token while the answer is written.
MAX_PATTERN_SIZE = 20_000


class _Grammars:
    """The compiled grammars: (grammar, error) by schema hash, LRU, bounded in bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.size = max_bytes, 0
        self.items: "OrderedDict[str, tuple[str, str]]" = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: str) -> tuple[str, str] | None:
        with self.lock:
            found = self.items.get(key)
            if found is not None:
                self.items.move_to_end(key)
            return found

    def put(self, key: str, value: tuple[str, str]) -> None:
        with self.lock:
            if key in self.items:
                return
            self.items[key] = value
            self.size += len(value[0]) + len(value[1])
            while self.size > self.max_bytes and len(self.items) > 1:
                _, old = self.items.popitem(last=False)
                self.size -= len(old[0]) + len(old[1])


_grammars = _Grammars(GRAMMAR_CACHE_BYTES)


def _compile(schema_json: str) -> tuple[str, str]:
    """(grammar, error message or "") for a schema given as canonical JSON text."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_json, defaults=_OPTIONS)
        return grammar, LLMatcher.validate_grammar(grammar)
    except Exception as exc:  # noqa: BLE001 - any failure here means an unusable schema
        return "", str(exc) or type(exc).__name__


def schema_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def check_schema(schema: Any) -> str:
    """The llguidance grammar for a JSON Schema, compiled once per distinct schema (cached by its
    hash); raises InvalidRequest (starting "json_schema") for a schema that cannot be enforced:
    not a JSON object, a `$ref` that loops on one value, a pattern too large, or one the grammar
    engine refuses (including its own limits on a grammar's size)."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"json_schema must be a JSON Schema object, got {json.dumps(schema)[:200]}",
                             field="json_schema", code="invalid_value")
    try:
        text = json.dumps(schema, allow_nan=False)  # key order matters
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"json_schema must be plain JSON ({exc})", field="json_schema",
                             code="invalid_value") from None
    key = schema_key(text)
    found = _grammars.get(key)
    if found is None:
        error = _unenforceable(schema)
        found = ("", error) if error else _compile(text)
        _grammars.put(key, found)
    grammar, error = found
    if error:
        raise InvalidRequest(f"json_schema is not a supported JSON Schema: {error.strip()}",
                             field="json_schema", code="invalid_value")
    return grammar


def _unenforceable(schema: dict[str, Any]) -> str:
    """Why the grammar engine could not use `schema` although it may compile it ("" if none)."""
    loop = ref_loop(schema)
    if loop is not None:
        return (f"it refers to itself through {json.dumps(loop)}: no JSON value can match it")
    for pattern in _patterns(schema):
        size = pattern_size(pattern)
        if size > MAX_PATTERN_SIZE:
            return (f"the pattern {json.dumps(pattern[:80])} repeats to {size:,} pieces; the limit "
                    f"is {MAX_PATTERN_SIZE:,}")
    return ""


def _patterns(schema: Any) -> list[str]:
    """Every regular expression in a schema: `pattern` values and `patternProperties` keys."""
    found, pending = [], [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found.extend(node["patternProperties"])
            pending.extend(node.values())
    return found


_QUANTIFIER = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")


def _atom_end(pattern: str, i: int) -> int:
    """Where the atom starting at `i` ends when it is an escape or a character class (else i)."""
    if pattern[i] == "\\":
        return i + 2
    if pattern[i] != "[":
        return i
    j = i + 1
    while j < len(pattern) and (pattern[j] != "]" or j == i + 1):
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def pattern_size(pattern: str) -> int:
    """How many pieces `pattern` unrolls to (each atom once per repetition a counted quantifier
    asks for, alternatives added up): an upper estimate of the lexer it makes."""
    stack: list[list[int]] = [[0, 0]]  # per open group: (total of closed branches, this branch)
    last = 0  # the size of the piece a quantifier would repeat
    i = 0
    while i < len(pattern):
        c, end = pattern[i], _atom_end(pattern, i)
        quantifier = _QUANTIFIER.match(pattern, i) if c == "{" else None
        if end > i or c not in "()|*+?^${":  # one atom: an escape, a class, a character
            last = 1
            stack[-1][1] += 1
            i = max(end, i + 1)
            continue
        if quantifier:
            low, comma, high = quantifier.groups()
            times = int(high) if high else int(low or 0) + (1 if comma else 0)
            stack[-1][1] += last * max(times - 1, 0)
            last *= max(times, 1)
            i = quantifier.end()
            continue
        if c == "(":
            stack.append([0, 0])
        elif c == "|":
            stack[-1][0] += stack[-1][1]
            stack[-1][1] = 0
        elif c == ")" and len(stack) > 1:
            closed, branch = stack.pop()
            last = closed + branch
            stack[-1][1] += last
        i += 1
    while len(stack) > 1:
        closed, branch = stack.pop()
        stack[-1][1] += closed + branch
    return stack[0][0] + stack[0][1]


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


def ref_loop(schema: dict[str, Any]) -> str | None:
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


_tokenizers: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of a model's tokenizer (an mlx-lm `TokenizerWrapper`), built once per
    tokenizer (it takes about half a second) and shared by all its requests."""
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    with _tokenizers_lock:
        found = _tokenizers.get(hf)
        if found is None:
            try:
                found = llguidance.hf.from_tokenizer(hf, eos_token=sorted(tokenizer.eos_token_ids))
            except Exception as exc:  # noqa: BLE001 - e.g. a slow (non-Rust) tokenizer
                raise InvalidRequest(f"JSON mode is not available for this model's tokenizer "
                                     f"({exc})", field="json_schema",
                                     code="invalid_value") from None
            _tokenizers[hf] = found
        return found


MATCHERS_KEPT = 32
_matchers: "OrderedDict[str, tuple[Any, Any]]" = OrderedDict()
_matchers_lock = threading.Lock()


def new_matcher(tokenizer: Any, grammar: str) -> Any:
    """A fresh llguidance matcher of `grammar` for `tokenizer`: a copy of one built once per
    (tokenizer, grammar) and kept (MATCHERS_KEPT of them, least recently used out), since
    building one walks the whole vocabulary (up to a second for a large tool set)."""
    from llguidance import LLMatcher

    key = schema_key(grammar)
    with _matchers_lock:
        found = _matchers.get(key)
        if found is not None and found[0] is tokenizer:
            _matchers.move_to_end(key)
            return found[1].deep_copy()
    template = LLMatcher(tokenizer, grammar, log_level=0)
    with _matchers_lock:
        _matchers[key] = (tokenizer, template)
        while len(_matchers) > MATCHERS_KEPT:
            _matchers.popitem(last=False)
    return template.deep_copy()


class JsonConstraint:
    """One request's grammar state, as a logits processor (see the module docstring)."""

    def __init__(self, tokenizer: Any, grammar: str, prompt_length: int):
        self.matcher = new_matcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise InvalidRequest(f"json_schema cannot be used: {self.matcher.get_error()}",
                             field="json_schema", code="invalid_value")
        self.vocab = tokenizer.vocab_size
        self.seen = prompt_length  # history up to here needs no consuming
        self._bitmask = np.zeros((self.vocab + 31) // 32, dtype=np.int32)

    def accept(self, token: int) -> None:
        """Advance the grammar by a sampled token."""
        if not self.matcher.consume_token(token):
            raise EngineError(f"JSON mode: token {token} broke the grammar "
                              f"({self.matcher.get_error()})")

    def allowed(self, width: int) -> mx.array:
        """The tokens the grammar allows next, as a boolean row of `width` (the logits' width)."""
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if self.matcher.is_error():
            raise EngineError(f"JSON mode: {self.matcher.get_error()}",
                             field="json_schema", code="invalid_value")
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: min(width, self.vocab)]
        if width > bits.size:  # model rows past the tokenizer's vocabulary: never allowed
            bits = np.concatenate([bits, np.zeros(width - bits.size, dtype=np.uint8)])
        return mx.array(bits.astype(np.bool_))

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        n = history.shape[0]
        if n > self.seen:
            for token in history[self.seen:].tolist():
                self.accept(token)
            self.seen = n
        return mx.where(self.allowed(logits.shape[-1]), logits, -mx.inf)


def json_constraint(lm: Any, schema: dict, prompt_length: int) -> JsonConstraint:
    """A fresh constraint for one request on `lm` whose prompt has `prompt_length` tokens."""
    return JsonConstraint(ll_tokenizer(lm.tokenizer), check_schema(schema), prompt_length)
