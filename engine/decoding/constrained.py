"""JSON mode: constrained decoding with llguidance, so that the output must parse (and match a JSON
Schema when one is given).

A request's schema is compiled once to an llguidance grammar (`check_schema`, called by
`SamplingParams.validate`). Its `JsonConstraint` is a logits processor like mlx-lm's: it is called
as `processor(history, logits)` before sampling, advances its matcher by the tokens that were added
to `history` since its last call (the previously sampled token; nothing on the first call, which
predicts the first answer token from the prompt) and masks every token the grammar forbids to -inf.
Once the JSON value is complete the grammar allows only EOS, so the request stops there.

JSON is compact by default (no whitespace between tokens): a small model allowed free whitespace
can loop on newlines forever. A schema may ask otherwise through llguidance's `x-guidance` options.
An answer cut by `max_tokens` (finish_reason "length") is still unfinished JSON.
"""

import functools
import json
import threading
import weakref
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import EngineError, InvalidRequest

# `{"type": "json_object"}` of the OpenAI API: any JSON object.
_OPTIONS = {"whitespace_flexible": False}


@functools.lru_cache(maxsize=64)
def _compile(schema_json: str) -> tuple[str, str]:
    """(grammar, error message or "") for a schema given as canonical JSON text."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_json, defaults=_OPTIONS)
        return grammar, LLMatcher.validate_grammar(grammar)
    except Exception as exc:  # noqa: BLE001 - any failure here means an unusable schema
        return "", str(exc) or type(exc).__name__


def check_schema(schema: Any) -> str:
    """The llguidance grammar for a JSON Schema; raises InvalidRequest (starting "json_schema")."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"json_schema must be a JSON Schema object, got {json.dumps(schema)}",
                             field="json_schema", code="invalid_value")
    try:
        text = json.dumps(schema, allow_nan=False)  # key order matters
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"json_schema must be plain JSON ({exc})", field="json_schema",
                             code="invalid_value") from None
    grammar, error = _compile(text)
    if error:
        raise InvalidRequest(f"json_schema is not a supported JSON Schema: {error.strip()}",
                             field="json_schema", code="invalid_value")
    return grammar


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


class JsonConstraint:
    """One request's grammar state, as a logits processor (see the module docstring)."""

    def __init__(self, tokenizer: Any, grammar: str, prompt_length: int):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
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
