"""One request's generation: chunked prefill that stops only where a snapshot is taken
(engine/decoding/snapshots.py), then decoding one token per step. `Generation.step()` does one unit of work so a scheduler can interleave requests and
cancel between steps; `generate()` runs it to the end for callers that just want the events.

The decode loop mirrors `mlx_lm.generate.generate_step` (the next step's graph is built and
evaluated asynchronously before the current token is read), and sampling draws from a per-request
key in the same order, so tokens equal mlx-lm's for the same model, prompt and sampler.
"""

import time
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .channels import ChannelSplitter, Markers
from .chat import Prompt, encode_text, render
from .exclusions import check_exclusions
from .fim import Infill, render_infill
from ..device import backend, memory_budget
from ..errors import InvalidRequest
from ..events import Channel, Event, Timings, Usage
from ..kernels.head import last_logits
from ..loading.registry import LoadedModel
from .logprobs import token_logprob
from .sampling import SamplingParams, TokenSampler
from .snapshots import POLICY
from .stops import StopMatcher
from .thinking import thinking_budget
from .tools import ToolRequest, constraint as tool_constraint, markers as tool_markers, parse_calls
from .tools import prepare as prepare_tools
from .vision import has_images, render_with_images

if TYPE_CHECKING:
    from .speculative import Speculator



def default_prefill_chunk(lm: LoadedModel | None = None) -> int:
    """Prompt tokens per prefill forward. Each chunk ends with an evaluation (a device sync on a
    GPU, where large chunks pay); on the CPU one chunk is seconds of work during which no other
    request decodes, so chunks stay small there. On CUDA, given the model, the chunk is sized
    against memory (`memory_sized_chunk`)."""
    largest = {"cuda": 4096, "cpu": 512}.get(backend(), 2048)
    if lm is None or backend() != "cuda":
        return largest
    return memory_sized_chunk(lm, largest)


# A prefill chunk's activations may take this share of the weights' bytes (at least
# CHUNK_ACTIVATIONS_MIN bytes, at most a tenth of the device's memory).
CHUNK_ACTIVATIONS_OF_WEIGHTS = 0.25
CHUNK_ACTIVATIONS_MIN = 1 << 30
SMALLEST_CHUNK = 256


def activation_bytes_per_token(config: dict[str, Any]) -> int:
    """An estimate of the activation bytes one prompt token of a chunk holds at its peak on CUDA:
    per layer two hidden-wide and three MLP-wide 2-byte rows. Measured on the H200 (MLX 0.32.4;
    bench/results/cuda-h200-2026-issue34-*.json): Qwen3-8B ~2.8 MB per chunk token (estimate
    3.2), the Qwen3.5-9B hybrid 2-3.4 MB (estimate 2.9)."""
    text = config.get("text_config", config)
    return text["num_hidden_layers"] * (2 * text["hidden_size"] + 3 * text["intermediate_size"]) * 2


def memory_sized_chunk(lm: LoadedModel, largest: int) -> int:
    """The largest power-of-two chunk, from `largest` down to SMALLEST_CHUNK, whose estimated
    activations fit the chunk budget. MLX's CUDA backend keeps a chunk's intermediates until its
    work completes, so peak memory grows with the chunk: on the H200 a 4,096-token chunk put
    Qwen3-8B's peak at 1.17x mlx-lm's (2,048-token) and 1,024 at 0.91x, for 17% more cold TTFT;
    the 9B hybrid's peak fell from 17.8 to 11.3 GB at 512 and its TTFT too. Computed once per
    model (kept in `lm.extras`)."""
    if "prefill_chunk" in lm.extras:
        return lm.extras["prefill_chunk"]
    try:
        per_token = activation_bytes_per_token(lm.config)
    except (KeyError, TypeError):
        return largest
    weights = sum(p.nbytes for _, p in tree_flatten(lm.model.parameters()))
    budget = min(max(weights * CHUNK_ACTIVATIONS_OF_WEIGHTS, CHUNK_ACTIVATIONS_MIN), memory_budget(0.1))
    chunk = largest
    while chunk > SMALLEST_CHUNK and chunk * per_token > budget:
        chunk //= 2
    lm.extras["prefill_chunk"] = chunk
    return chunk


# The final prefill chunk's head runs on its last row only (engine/kernels/head.py); a switch so
# that bench.gpu_step can measure the memory it saves in the same process.
LAST_ROW_HEAD = True

# The last prompt token rides with a final prefill chunk of at most this many tokens (its logits
# read from that call: every position's logits are computed, so only for short chunks).
LAST_WITH_CHUNK_MAX = 512


def last_with_chunk_default() -> bool:
    """Whether a prompt's last token goes through the model with its final prefill chunk rather
    than in a call of its own (as mlx-lm's `generate_step` feeds it). On a GPU the call of its own
    costs a pass over the weights and a sync in every time to first token (a decode step's time,
    a large part of an edited turn's); on the CPU it stays alone, so tokens equal mlx-lm's bit for
    bit."""
    return mx.default_device() == mx.gpu


class PrefixStore(Protocol):
    """What generation needs from a prefix cache (see engine/prefix_cache/store.py)."""

    def fetch(self, tokens: Sequence[int]) -> tuple[list[Any], int]:
        """A private, mutable model cache holding the longest reusable prefix of `tokens`
        (at most len(tokens) - 1 of them) and how many tokens it holds."""

    def save(self, tokens: Sequence[int], cache: list[Any]) -> None:
        """Snapshot `cache`, which holds exactly `tokens`; later mutation must not affect it."""

    def branch_point(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the cached snapshots share (where this prompt leaves
        what is cached)."""


def build_prompt(lm: LoadedModel, messages: Sequence[dict] | None = None,
                 prompt_tokens: Sequence[int] | None = None, text: str | None = None,
                 tools: ToolRequest | None = None, with_checkpoints: bool = True,
                 infill: Infill | None = None) -> Prompt:
    """Exactly one of messages (chat template, with `tools` offered), prompt_tokens, text (raw)
    or infill (fill-in-the-middle, engine/decoding/fim.py). Without `with_checkpoints` a
    rendered prompt's only checkpoint is its end (to count tokens)."""
    if sum(x is not None for x in (messages, prompt_tokens, text, infill)) != 1:
        raise InvalidRequest("give exactly one of messages, prompt_tokens, text or infill")
    if infill is not None:
        return render_infill(lm, infill)
    if messages is not None and (has_images(messages) or "vision" in lm.extras):  # vision.py
        return render_with_images(lm, messages, tools, with_checkpoints)
    if messages is not None:
        msgs, kwargs = prepare_tools(lm.tokenizer, messages, tools)
        return render(lm.tokenizer, msgs, with_checkpoints=with_checkpoints, **kwargs)
    if text is not None:
        return encode_text(lm.tokenizer, text)
    tokens = list(prompt_tokens or [])
    vocab = lm.config.get("vocab_size") or len(lm.tokenizer.vocab)
    if not tokens:
        raise InvalidRequest("the prompt is empty")
    if not all(isinstance(t, int) and 0 <= t < vocab for t in tokens):
        raise InvalidRequest(f"prompt_tokens must be integers in [0, {vocab})")
    return Prompt(tokens=tokens, checkpoints=[len(tokens)], continued=True)  # raw, as `text`


def check_model_ranges(params: SamplingParams, vocab: int) -> None:
    """The sampling options whose range depends on the model: top_k at most its vocabulary."""
    if params.top_k > vocab:
        raise InvalidRequest(f"top_k must be at most this model's vocabulary of {vocab} tokens "
                             f"(0: all), got {params.top_k}", field="top_k", code="invalid_value")


def check_vocabulary(lm: LoadedModel, params: SamplingParams) -> None:
    """The options that name token ids or count them stay within the model's vocabulary."""
    vocab = lm.config.get("vocab_size") or len(lm.tokenizer.vocab)
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise InvalidRequest(f"logit_bias token ids must be below {vocab}", field="logit_bias",
                             code="invalid_value")
    check_model_ranges(params, vocab)


def check_fits(lm: LoadedModel, prompt: Prompt, params: SamplingParams) -> None:
    limit = lm.context_length
    n = len(prompt.tokens)
    if n >= limit:
        raise InvalidRequest(f"the prompt has {n} tokens; this model's context is {limit} tokens",
                             field="messages", code="context_length_exceeded")
    if n + params.max_tokens > limit:
        raise InvalidRequest(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds this model's context "
            f"of {limit} tokens; lower max_tokens to at most {limit - n}",
            field="max_tokens", code="context_length_exceeded")


class Generation:
    """The state of one request from prefill to its final event."""

    def __init__(self, lm: LoadedModel, prompt: Prompt, params: SamplingParams,
                 prefix_cache: PrefixStore | None = None, prefill_chunk: int | None = None,
                 speculator: "Speculator | None" = None, tools: ToolRequest | None = None,
                 split_reasoning: bool = False, last_with_chunk: bool | None = None):
        """`tools`: the request's tools (their calls are parsed, and constrained where they must
        be made); `split_reasoning`: token events say which channel their text is in;
        `last_with_chunk`: see `last_with_chunk_default` (None: that default)."""
        check_fits(lm, prompt, params)
        self.tools = tools if tools is not None and tools.choice != "none" else None
        budget = thinking_budget(lm.tokenizer, params.thinking_budget, prompt.tokens)
        check_exclusions(speculative=speculator is not None, logprobs=params.logprobs is not None,
                         tools=self.tools is not None, images=prompt.vision is not None,
                         thinking_budget=budget is not None,
                         json_schema=params.json_schema is not None)
        check_vocabulary(lm, params)
        self.vision = prompt.vision  # its images (engine/decoding/vision.py), or None
        self.speculator = speculator  # opt-in: decode by draft-and-verify (engine/decoding/speculative.py)
        self.lm, self.prompt, self.params = lm, prompt, params
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk or default_prefill_chunk(lm)
        self.last_with_chunk = last_with_chunk_default() if last_with_chunk is None else last_with_chunk
        self.sampler = TokenSampler(params)
        # logits processors in order: the thinking budget, then any grammar (a forced closing
        # marker is not JSON), which masks the logits last
        if budget is not None:
            self.sampler.processors.append(budget)
        if params.json_schema is not None:  # JSON mode
            from .constrained import json_constraint

            self.sampler.processors.append(json_constraint(lm, params.json_schema,
                                                           len(prompt.tokens)))
        calls = tool_constraint(lm.tokenizer, self.tools, len(prompt.tokens)) if self.tools else None
        if calls is not None:
            self.sampler.processors.append(calls)
        self.channels = self._channels(lm, prompt, split_reasoning)
        self.tool_text = ""
        self._pending_logprobs: mx.array | None = None
        self.detokenizer = lm.tokenizer.detokenizer
        if prompt.continued and "text" in vars(self.detokenizer):
            # mlx-lm's streaming detokenizers drop the space that starts an answer; continuing a
            # message, that space separates its last word from the next one: keep it.
            self.detokenizer.text, self.detokenizer.offset = " ", 1
        self.stop_matcher = StopMatcher(params.stop)
        self.eos = set(lm.tokenizer.eos_token_ids) | set(prompt.stop_tokens)
        self.created = time.perf_counter()
        self.started: float | None = None
        self.first_token_at: float | None = None
        self.cache: list[Any] | None = None
        self.reused = 0
        self.fed: list[int] = []  # tokens whose keys/values are in self.cache
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self._next: tuple[mx.array, mx.array | None] | None = None  # token, model logprobs
        self._history: mx.array | None = None
        self._stops: list[int] = []  # prompt positions where prefill saves a snapshot
        # With a speculator: plain tokens to decode before the next speculative round (None: plain
        # to the end, speculation switched itself off; engine/decoding/speculative.py decides).
        self._plain_left: int | None = speculator.opening_run() if speculator is not None else 0
        self._cancel = False

    def _channels(self, lm: LoadedModel, prompt: Prompt, split_reasoning: bool) -> ChannelSplitter | None:
        tok = lm.tokenizer
        think = (tok.think_start, tok.think_end) if split_reasoning and tok.has_thinking else None
        tool_open = tool_markers(tok)[0] if self.tools is not None and not self.tools.forced else None
        if think is None and self.tools is None:
            return None
        start: Channel = "content"
        if self.tools is not None and self.tools.forced:
            start = "tool"
        elif think and tok.think_start_tokens and tok.think_end_tokens:
            # A template that opens the thinking block itself: the answer starts inside it.
            opened = tok.rfind_think_start(prompt.tokens)
            if opened != -1 and tok.rfind_think_end(prompt.tokens) < opened:
                start = "reasoning"
        return ChannelSplitter(Markers(think, tool_open), start)

    # -- lifecycle -----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return self.first_token_at is None and self._next is None

    def cancel(self) -> None:
        """Ask to stop; takes effect at the next step (thread-safe: it only sets a flag)."""
        self._cancel = True

    def _begin(self) -> None:
        self.started = time.perf_counter()
        tokens = self.prompt.tokens
        key = self._key(tokens)
        if self.prefix_cache is not None:
            self.cache, self.reused = self.prefix_cache.fetch(key)
        else:
            self.cache, self.reused = make_prompt_cache(self.lm.model), 0
        self.fed = list(tokens[: self.reused])
        branch = self.prefix_cache.branch_point(key) if self.prefix_cache is not None else 0
        self._stops = POLICY.prefill_stops(self.prompt, self.reused,
                                           self.lm.caches.trimmable(self.cache), branch)
        if self.sampler.processors:
            self._history = mx.array(self.fed, dtype=mx.uint32)

    def _feed(self, inputs: mx.array, last_only: bool = False) -> mx.array:
        """Run the model over `inputs` (1-D, possibly not yet evaluated); returns the logits (with
        `last_only`, those of the last position alone: the head runs on that row only)."""
        if self._history is not None:
            self._history = mx.concatenate([self._history, inputs])
        if self.speculator is not None:
            return self.speculator.prefill(inputs, self.cache, len(self.fed))
        if self.vision is not None:
            return self.vision.forward(self.lm.model, inputs, len(self.fed), self.cache)
        if last_only and LAST_ROW_HEAD:
            return last_logits(self.lm.model, inputs[None], self.cache)
        return self.lm.model(inputs[None], cache=self.cache)

    def _key(self, tokens: Sequence[int]) -> list[int]:
        """The prefix-cache key of `tokens`: the tokens, each image's tokens replaced by its
        image's key (engine/decoding/vision.py)."""
        return self.vision.key(tokens) if self.vision is not None else list(tokens)

    def _save(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.save(self._key(self.fed), self.cache)

    # -- work ----------------------------------------------------------------------------------
    def step(self, prefill_limit: int | None = None) -> list[Event]:
        """One prefill chunk (of at most `prefill_limit` prompt tokens, if given) or one decoded
        token; returns the events it produced."""
        if self.done:
            return []
        if self._cancel:
            return self._finish("cancelled")
        if self.cache is None:
            self._begin()
        if self.in_prefill:
            return self._prefill_step(prefill_limit or self.prefill_chunk)
        return self._decode_step()

    @property
    def prefill_left(self) -> int:
        """Prompt tokens not yet fed to the model (0 once decoding)."""
        if not self.in_prefill:
            return 0
        return len(self.prompt.tokens) - len(self.fed)

    def _prefill_step(self, limit: int) -> list[Event]:
        tokens = self.prompt.tokens
        last = len(tokens) - 1  # its logits give the first token
        pos = len(self.fed)
        if pos < last:
            stop = next((s for s in self._stops if s > pos), last)
            end = min(stop, pos + min(limit, self.prefill_chunk))
            if self.last_with_chunk and end == last and last not in self._stops:
                if end - pos < LAST_WITH_CHUNK_MAX:
                    return self._prefill_last(pos)  # the final chunk takes the last token
                # too long to take it: end early, leaving a final chunk short enough to take it
                # (its logits cost less than a call over the weights for the last token alone)
                end = last - (LAST_WITH_CHUNK_MAX - 1)
            self._feed(mx.array(tokens[pos:end], dtype=mx.uint32))
            self.fed.extend(tokens[pos:end])
            mx.eval([c.state for c in self.cache])
            if end in self._stops:
                self._save()
            return []
        return self._prefill_last(last)

    def _prefill_last(self, pos: int) -> list[Event]:
        """Feed the prompt from `pos` to its end and sample the first token from the last logits."""
        tokens = self.prompt.tokens
        logits = self._feed(mx.array(tokens[pos:], dtype=mx.uint32), last_only=True)
        self.fed.extend(tokens[pos:])
        self._next = self.sampler(logits[:, -1, :], self._history)
        mx.async_eval(*self._next)
        self._save()  # the whole prompt
        return []

    # Prefill split around its model call, so that engine/scheduling/batch.py can prefill several
    # requests in one call: `prefill_input` then, after the call, `prefilled` do what
    # `_prefill_step` does.
    def prefill_input(self, limit: int, with_last: bool = False) -> list[int]:
        """Start the request if it has not started, and return the prompt tokens its next prefill
        step feeds: a chunk of at most `limit` ending at the next stop, or the last prompt token
        alone (whose logits give the first token). `with_last`: a chunk that reaches the last
        token takes it too (when no snapshot is taken just before it), as `last_with_chunk` does."""
        if self.cache is None:
            self._begin()
        tokens, pos = self.prompt.tokens, len(self.fed)
        last = len(tokens) - 1
        if pos < last:
            stop = next((s for s in self._stops if s > pos), last)
            end = min(stop, pos + min(limit, self.prefill_chunk))
            if with_last and end == last and last not in self._stops:
                end += 1
            return list(tokens[pos:end])
        return list(tokens[last:])

    def prefilled(self, tokens: list[int], cache: list[Any], logits: mx.array | None) -> None:
        """`tokens` (from `prefill_input`) went through the model into `cache`, this request's own
        cache from now on; `logits` (1, vocab) follow the last prompt token, when they were fed."""
        self.cache = cache
        if self._history is not None:
            self._history = mx.concatenate([self._history, mx.array(tokens, dtype=mx.uint32)])
        self.fed.extend(tokens)
        if logits is None:
            if len(self.fed) in self._stops:
                self._save()
            return
        self._next = self.sampler(logits, self._history)
        mx.async_eval(*self._next)
        self._save()  # the whole prompt

    @property
    def prefills_alone(self) -> bool:
        """Whether its prefill must run in its own model calls (a speculator prefills its draft
        with the target; images take their own embeddings and positions)."""
        return self.speculator is not None or self.vision is not None

    def _decode_step(self) -> list[Event]:
        spec = self.speculator
        if spec is None:
            return self._plain_step()
        start, emitted = time.perf_counter(), len(self.generated)
        if self._next is None:  # speculating: the cache lags the emitted sequence
            self._plain_left = spec.plain_run(emitted)
            if self._plain_left == 0:
                events = self._speculative_step()
                spec.record(True, len(self.generated) - emitted, time.perf_counter() - start)
                return events
            self._resume_plain()
            return []
        if self._plain_left == 0:  # the token the cache lacks: emit it, then speculate from it
            y, _ = self._next
            self._next = None
            return self._emit([y.item()])
        events = self._plain_step()
        if emitted:  # the first token's step also waited for the end of prefill
            spec.record(False, len(self.generated) - emitted, time.perf_counter() - start)
        if self._plain_left:
            self._plain_left -= 1
        return events

    def _plain_step(self) -> list[Event]:
        if self.feeds_last:
            return self.accept_last(self._next[0].item())
        inputs = self.decode_input()
        if self.vision is not None:
            logits = self.vision.forward(self.lm.model, inputs, len(self.fed), self.cache)
        else:
            logits = self.lm.model(inputs[None], cache=self.cache)
        return self.decode_output(logits[:, -1, :])

    def _resume_plain(self) -> None:
        """From speculative to plain decoding: feed the target what its cache lacks of the emitted
        tokens and sample the next one, as the end of prefill does."""
        seq = list(self.prompt.tokens) + self.generated
        logits = self.lm.model(mx.array(seq[len(self.fed):], dtype=mx.uint32)[None], cache=self.cache)
        self.fed = seq
        if self.sampler.processors:
            self._history = mx.array(seq, dtype=mx.uint32)
        self._next = self.sampler(logits[:, -1, :], self._history)
        mx.async_eval(*self._next)

    # A decode step split around its model call, so that engine/scheduling/batch.py can run one model call
    # for many generations; `_decode_step` is `decode_output(model(decode_input()))`.
    @property
    def batchable(self) -> bool:
        """Decoding plainly with a token to feed next (not cancelled). A row's last token is fed
        too (one wasted row of a model call that runs anyway), so it need not leave the batch
        before its last step. A request with images decodes alone (its positions and cache keys
        are its own)."""
        return (self.vision is None and (self.speculator is None or self._plain_left is None)
                and self.finish_reason is None and not self._cancel and self._next is not None)

    @property
    def next_token(self) -> mx.array:
        """The sampled token not yet fed, shape (1,) (possibly not evaluated yet)."""
        return self._next[0].reshape(1)

    def decode_input(self) -> mx.array:
        """The sampled token not yet fed, as model input of shape (1,), added to the history."""
        inputs = self.next_token.astype(mx.uint32)
        if self._history is not None:
            self._history = mx.concatenate([self._history, inputs])
        return inputs

    def decode_output(self, logits: mx.array) -> list[Event]:
        """Sample the next token from `logits` (1, vocab) for `decode_input()`'s token, start
        evaluating it before reading this one (as mlx-lm does), and emit this one."""
        y = self.sample_next(*self.sampler(logits, self._history))
        mx.async_eval(*self._next)
        return self.accept(y.item())

    @property
    def history(self) -> mx.array | None:
        """The tokens so far (prompt + output fed), kept only when a logits processor reads them."""
        return self._history

    def sample_next(self, token: mx.array, model_logprobs: mx.array | None) -> mx.array:
        """`token` (1,), sampled (not yet evaluated) with `model_logprobs` (1, vocab) from the
        logits of `decode_input()`'s token, is the next one; returns the token sampled before it
        (the one fed), which `accept` must get once read. A batch samples all rows at once
        (engine/decoding/sampling.py `sample_rows`) and evaluates them together, and passes
        `model_logprobs` only for a request that asked for logprobs."""
        y, self._pending_logprobs = self._next
        self._next = (token, model_logprobs)
        return y

    def accept(self, token: int) -> list[Event]:
        """`token` (fed to the model by the last step) is read: record and emit it."""
        self.fed.append(token)
        return self._emit([token])

    @property
    def feeds_last(self) -> bool:
        """The sampled token not yet fed is the last one `max_tokens` allows: it is read and
        emitted without a model call (`accept_last`); nothing would read that call's logits."""
        return self._next is not None and len(self.generated) + 1 >= self.params.max_tokens

    def accept_last(self, token: int) -> list[Event]:
        """`token`, the sampled token not yet fed (`feeds_last`), is read: emit it and finish,
        leaving it out of `fed` (the cache never holds it)."""
        self._pending_logprobs = self._next[1]
        self._next = None
        return self._emit([token])

    def _speculative_step(self) -> list[Event]:
        seq = list(self.prompt.tokens) + self.generated
        new, held = self.speculator.step(seq, self.cache, len(self.fed),
                                         self.params.max_tokens - len(self.generated),
                                         self.sampler, self.eos)
        self.fed = (seq + new)[:held]
        return self._emit(new)

    def _emit(self, tokens: list[int]) -> list[Event]:
        """Token events for `tokens` in order, ending the request at EOS, a stop string or the limit."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        events = []
        for token in tokens:
            if token in self.eos:
                return events + self._finish("stop")
            self.generated.append(token)
            self.detokenizer.add_token(token)
            text, hit_stop = self.stop_matcher.feed(self.detokenizer.last_segment)
            events.extend(self._token_events(text, token))
            if hit_stop:
                return events + self._finish("stop", flush=False)
            if len(self.generated) >= self.params.max_tokens:
                return events + self._finish("length")
        return events

    def _token_events(self, text: str, token: int) -> list[Event]:
        """One token's events: its logprobs, and its text by channel when the request splits them
        (the token rides on the first event; a text straddling a marker gives more than one)."""
        logprobs = None
        if self.params.logprobs is not None and self._pending_logprobs is not None:
            logprobs = token_logprob(self.lm.tokenizer, self._pending_logprobs, token,
                                     self.params.logprobs)
        if self.channels is None:
            return [Event("token", text=text, token=token, logprobs=logprobs)]
        pieces = self.channels.feed(text) or [(self.channels.channel, "")]
        return [Event("token", text=piece, token=token if i == 0 else None, channel=channel,
                      logprobs=logprobs if i == 0 else None)
                for i, (channel, piece) in enumerate(self._route(pieces))]

    def _route(self, pieces: list[tuple[Channel, str]]) -> list[tuple[Channel, str]]:
        """Tool-channel text is kept for parsing at the end, not streamed."""
        out = []
        for channel, piece in pieces:
            if channel == "tool":
                self.tool_text += piece
                piece = ""
            out.append((channel, piece))
        return out

    def _finish(self, reason: str, flush: bool = True) -> list[Event]:
        self.finish_reason = reason
        text = ""
        if flush:
            self.detokenizer.finalize()
            # An answer cut mid-character ends in undecodable bytes: drop them, never emit U+FFFD.
            text, _ = self.stop_matcher.feed(self.detokenizer.last_segment.rstrip("\ufffd"))
            text += self.stop_matcher.flush()
        calls: tuple = ()
        tail: list[Event] = []
        if self.channels is not None:  # the rest of the text goes out as token-less events
            pieces = self._route(self.channels.feed(text) + self.channels.flush())
            text = ""
            if self.tools is not None and self.tool_text and reason in ("stop", "length"):
                try:
                    calls = tuple(parse_calls(self.lm.tokenizer, self.tools, self.tool_text))
                except Exception:  # noqa: BLE001 - an unfinished or malformed call stays text
                    pieces.append(("content", self.tool_text))
                if calls and reason == "stop" and self.tools.choice != "named":  # as OpenAI
                    self.finish_reason = reason = "tool_calls"
            tail = [Event("token", text=piece, channel=channel) for channel, piece in pieces if piece]
        if self._next is not None:
            mx.eval(*self._next)  # let the step in flight finish so the cache is consistent
        if self.first_token_at is not None and POLICY.save_at_finish(reason):
            self._save()
        stats = {"speculative": self.speculator.stats()} if self.speculator is not None else {}
        if self.stop_matcher.hit is not None:  # which stop string ended the answer
            stats["stop_sequence"] = self.stop_matcher.hit
        return tail + [Event("done", text=text, finish_reason=reason, usage=self.usage(),
                             timings=self.timings(), stats=stats, tool_calls=calls)]

    def release(self) -> None:
        """Free an ended request's model cache and pending arrays; its output and counts stay."""
        self.cache, self._next, self._history = None, None, None

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt.tokens), completion_tokens=len(self.generated),
                     cached_tokens=self.reused)

    def timings(self) -> Timings:
        if self.first_token_at is None:
            return Timings(queued_s=(self.started or self.created) - self.created)
        decode_s = time.perf_counter() - self.first_token_at
        n = len(self.generated)
        prefill_s = self.first_token_at - (self.started or self.created)
        return Timings(
            queued_s=(self.started or self.created) - self.created,
            ttft_s=self.first_token_at - self.created,
            tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            prefill_tokens_per_s=(len(self.prompt.tokens) - self.reused) / prefill_s if prefill_s > 0 else None,
        )


def generate(lm: LoadedModel, prompt: Prompt, params: SamplingParams,
             prefix_cache: PrefixStore | None = None,
             speculator: "Speculator | None" = None, tools: ToolRequest | None = None,
             split_reasoning: bool = False) -> Iterator[Event]:
    """Run one request to completion in the calling thread, yielding its events."""
    gen = Generation(lm, prompt, params, prefix_cache=prefix_cache, speculator=speculator,
                     tools=tools, split_reasoning=split_reasoning)
    try:
        while not gen.done:
            yield from gen.step()
    finally:
        if not gen.done:  # the consumer stopped early
            gen.cancel()
            gen.step()
