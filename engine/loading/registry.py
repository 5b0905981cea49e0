"""Which models exist and how to load them: the bundled default, GGUF files, mlx-lm folders and
models in the local Hugging Face cache (downloaded by `mlxchat pull`, engine/loading/hub.py, or
by other tools)."""

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import bundled
from ..errors import ModelLoadError
from .folders import gguf_to_folder, hub_cache_dir
from .memory import shortfall, weight_files_bytes
from .progress import report
from .speech import refuse_speech_as_chat, speech_kind
from .vision import is_vision_folder
from .warm_up import warm_up
from ..model_cache import LOCAL, CacheOps
from ..kernels import native
from ..kernels.fastest import AS_LOADED, fastest_layout
from ..kernels.gated_delta import use_chunked_prefill
from ..kernels.kv8 import kv_bits, use_kv_bits
from ..paths import cache_dir

log = logging.getLogger(__name__)

DEFAULT_MODEL = bundled.BUNDLED_NAME


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str  # "bundled" | "folder" | "gguf" | "hf-cache"
    path: str | None
    size_bytes: int | None
    vision: bool = False  # a vision-language model's folder (engine/loading/vision.py)
    speech: str | None = None  # "transcription" or "speech": a speech model (loading/speech.py)


# What a model can do, as clients ask (Ollama's /api/show, /v1/models, the picker): one
# declaration, each derived from the model's own files in `capabilities`. `insert` is Ollama's name
# for fill-in-the-middle (a `suffix`, `/infill`).
CAPABILITIES = ("completion", "insert", "tools", "thinking", "vision", "embedding", "rerank")


def capabilities(lm: "LoadedModel") -> tuple[str, ...]:
    """The model's CAPABILITIES: a dedicated embedding model (sentence-transformers pooling,
    engine/decoding/pooling.py) only embeds, and reranks by cosine similarity; an LLM
    reranker (engine/loading/rerank_recipe.py) only reranks; every other model completes and
    embeds (mean pooling of its last hidden state); insert when its files declare FIM tokens
    (engine/loading/fim_tokens.py); tools when its tokenizer knows its family's tool-call
    markers or its chat template takes `tools`; thinking when it knows think markers; vision when
    it is a vision-language model loaded through mlx-vlm (engine/loading/vision.py)."""
    from .embedding_recipe import embedding_recipe
    from .fim_tokens import fim_tokens
    from .rerank_recipe import rerank_recipe

    if embedding_recipe(lm.path).dedicated:
        return ("embedding", "rerank")
    if rerank_recipe(lm.path) is not None:
        return ("rerank",)
    tok = lm.tokenizer
    template = getattr(tok, "chat_template", None) or ""
    found = ["completion"]
    if fim_tokens(tok, lm.path) is not None:
        found.append("insert")
    if getattr(tok, "has_tool_calling", False) or "tools" in template:
        found.append("tools")
    if getattr(tok, "has_thinking", False):
        found.append("thinking")
    if "vision" in lm.extras:
        found.append("vision")
    found.append("embedding")
    return tuple(found)


@dataclass
class LoadedModel:
    """A model ready to run: the mlx-lm module, its tokenizer wrapper and config."""

    name: str
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict[str, Any]
    path: Path
    extras: dict[str, Any] = field(default_factory=dict)
    caches: CacheOps = LOCAL  # how the engine copies, restores and batches its caches
    compute: str = AS_LOADED  # the compute path `load_model` gave it (engine/kernels/fastest.py)
    # A shorter context than the config's, set by the model's settings
    # (engine/scheduling/model_settings.py); None: the config's own.
    context_limit: int | None = None

    @functools.cached_property
    def weights_digest(self) -> str:
        """The weights by content (not by name or path), for files derived from them."""
        return weights_digest(self.path)

    @property
    def family(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def context_length(self) -> int:
        own = context_length(self.config)
        return min(own, self.context_limit) if self.context_limit else own


def context_length(config: dict[str, Any]) -> int:
    """The longest input a model with this config.json takes, in tokens."""
    text = config.get("text_config", config)
    for key in ("max_position_embeddings", "max_seq_len", "seq_length"):
        if key in text:
            return int(text[key])
    return 4096


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def weights_digest(folder: Path) -> str:
    """sha256 over a model folder's config.json and weights files, in name order.

    Each version of the files is read once: the digest is remembered under the cache directory,
    keyed by every file's name, size, modification time and inode."""
    folder = folder.resolve()
    files = sorted([folder / "config.json", *folder.glob("*.safetensors")])
    stats = [f.stat() for f in files]
    stamp = [[f.name, st.st_size, st.st_mtime_ns, st.st_ino] for f, st in zip(files, stats)]
    memo = cache_dir() / "weights-digests" / (hashlib.sha256(str(folder).encode()).hexdigest()[:16]
                                              + ".json")
    try:
        known = json.loads(memo.read_text())
        if known["files"] == stamp:
            return str(known["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = hashlib.sha256()
    for f, st in zip(files, stats):
        digest.update(f"{f.name}\0{st.st_size}\0".encode())
        with f.open("rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"files": stamp, "sha256": digest.hexdigest()}))
    os.replace(tmp, memo)
    return digest.hexdigest()


def _hf_cache_models() -> list[ModelInfo]:
    """mlx-lm folders (named owner/name) and GGUF files (owner/name:FILE.gguf) in the hub cache."""
    found = []
    for repo in sorted(hub_cache_dir().glob("models--*")):
        name = repo.name[len("models--"):].replace("--", "/")
        snapshots = sorted((repo / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
        if snapshots and any(snapshots[-1].parent.glob("*.safetensors")):
            folder = snapshots[-1].parent
            found.append(ModelInfo(name, "hf-cache", str(folder), _dir_size(folder.resolve()),
                                   vision=is_vision_folder(folder), speech=speech_kind(folder)))
        for gguf in sorted((repo / "snapshots").glob("*/**/*.gguf")):
            if gguf.is_file():
                file = gguf.relative_to(repo / "snapshots").as_posix().split("/", 1)[1]
                found.append(ModelInfo(f"{name}:{file}", "hf-cache", str(gguf), gguf.stat().st_size))
    return found


def list_models() -> list[ModelInfo]:
    """The bundled model first (size known once fetched), then the local Hugging Face cache."""
    gguf = bundled.gguf_path()
    models = [ModelInfo(DEFAULT_MODEL, "bundled", str(gguf) if gguf.exists() else None,
                        gguf.stat().st_size if gguf.exists() else None)]
    return models + _hf_cache_models()


def known_vision_models() -> list[str]:
    """The names of the local models that are vision models (engine/loading/vision.py)."""
    return [m.name for m in list_models() if m.vision]


def _starts_with_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # a file that cannot be read (/proc/self/mem): no model
        return False


def _local_path(name: str) -> Path | None:
    """`name` as a local path, if it names a file or folder that is there (a name no path can
    have, too long or holding NUL, is none)."""
    try:
        path = Path(name).expanduser()
        return path if path.exists() else None
    except (OSError, ValueError):
        return None


def resolve(name: str | None) -> tuple[str, Path]:
    """Map a model name or path to (display name, mlx-lm folder); raises ModelLoadError."""
    if name in (None, "", DEFAULT_MODEL, "default"):
        return DEFAULT_MODEL, gguf_to_folder(bundled.ensure_bundled_gguf())
    local = _local_path(name)
    if local is not None:
        return _local(local)
    cached = next((info for info in _hf_cache_models() if info.name == name), None)
    if cached is not None:  # owner/name (a folder), or owner/name:FILE.gguf (converted once)
        found = Path(cached.path)
        return cached.name, gguf_to_folder(found) if found.is_file() else found
    if name.endswith(".gguf"):
        raise ModelLoadError(f"GGUF file not found: {name[:300]}")
    known = ", ".join(m.name for m in list_models())
    shown = name if len(name) <= 300 else name[:300] + "…"
    raise ModelLoadError(f"unknown model {shown!r}: not a file or folder, not in the local cache "
                         f"(available: {known}); `mlxchat pull {shown}` downloads a hub model",
                         code="model_not_found")


def _local(path: Path) -> tuple[str, Path]:
    """A GGUF file (by its name or, under another name, by its magic) or an mlx-lm folder."""
    if path.is_file():
        if path.suffix == ".gguf" or _starts_with_gguf_magic(path):
            return path.stem, gguf_to_folder(path)
        raise ModelLoadError(f"{path} is not a model: give a GGUF file or an mlx-lm model folder "
                             "(one with config.json)")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} is not an mlx-lm model folder (no config.json)")
    return path.name, path


Transform = Callable[[nn.Module], nn.Module]


def _kv_bits(asked: int | None) -> int | None:
    """The KV cache's bits for a load: `asked` (8, or 16 for the full cache), else the process's
    default (MLXCHAT_KV_BITS)."""
    if asked is not None:
        return None if asked == 16 else asked
    try:
        return kv_bits()
    except ValueError as exc:
        raise ModelLoadError(str(exc), code="invalid_kv_bits") from None


def load_model(name: str | None = None, *, fallback_to_default: bool = False,
               transform: Transform | None = None,
               group: mx.distributed.Group | None = None,
               int8_activations: bool | None = None, kv_bits: int | None = None) -> LoadedModel:
    """Load a model by name or path. With `fallback_to_default`, a model that cannot load is
    logged with its reason and the bundled model is loaded instead; otherwise the error is raised.
    With a distributed `group`, keep only this rank's tensor-parallel shard (engine/distributed/);
    the shard stays in mlx-lm's own sharded layers, without the CPU layout. `int8_activations`:
    on our CPU kernels, take the lossy int8-activation path (None: the process's default,
    `--int8-activations`); a model that does not run on them ignores it. `kv_bits`: 8 for the
    8-bit KV cache, 16 for the full one (None: the process's default, MLXCHAT_KV_BITS).
    A model's settings (engine/scheduling/model_settings.py) pass both on every load."""
    from mlx_lm.utils import load_model as mlx_lm_load_model, load_tokenizer

    from .gemma2_window import model_classes
    from .shardable import check_shardable

    try:
        display, folder = resolve(name)
        why = shortfall(display, weight_files_bytes(folder.glob("*")))
        if why:
            raise ModelLoadError(f"not loading: {why}", code="insufficient_memory")
        _prepare_kernels()
        report("loading")
        if is_vision_folder(folder):
            return _load_vision_model(display, folder, group)
        refuse_speech_as_chat(display, folder)
        try:
            # mlx_lm.load's two steps, with Gemma 2's sliding window (gemma2_window.py)
            model, config = mlx_lm_load_model(folder, get_model_classes=model_classes)
            tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
        except Exception as exc:  # mlx-lm raises ValueError/KeyError/FileNotFoundError...
            raise ModelLoadError(f"cannot load model {display!r} from {folder}: {exc}") from exc
    except ModelLoadError as exc:
        if fallback_to_default and name not in (None, DEFAULT_MODEL):
            log.warning("model %r failed to load (%s); falling back to %s", name, exc, DEFAULT_MODEL)
            return load_model(None, transform=transform, int8_activations=int8_activations,
                              kv_bits=kv_bits)
        raise
    if group is not None:
        check_shardable(display, config, group.size())
        if not hasattr(model, "shard"):
            raise ModelLoadError(f"mlx-lm cannot shard {display!r} ({config.get('model_type')})")
        model.shard(group)
    if transform is not None:  # first: the layout below takes the layers the transform leaves
        model = transform(model)
    compute = AS_LOADED
    if group is None:
        model, compute = fastest_layout(model, config, int8_activations=int8_activations)
        use_kv_bits(model, config, _kv_bits(kv_bits))  # the 8-bit KV cache where asked for
    use_chunked_prefill(model)  # Qwen3.5 / Qwen3-Next: chunked linear-attention prefill
    # Materialise the weights here: lazy arrays belong to this thread's MLX stream, and the
    # scheduler thread that runs the model cannot evaluate them.
    mx.eval(model.parameters())
    _warm_up(model, group)
    return LoadedModel(name=display, model=model, tokenizer=tokenizer, config=config, path=folder,
                       compute=compute)


def _warm_up(model: nn.Module, group: mx.distributed.Group | None) -> None:
    """The model's first steps, now (engine/loading/warm_up.py); not for a sharded model, whose
    every step runs on all its ranks at once."""
    if group is None:
        report("warming up")
        warm_up(model)


def _prepare_kernels() -> None:
    """On the CPU, load our kernels before the weights (every model samples on them), building
    them first where this machine has no build yet: a stage of its own, not a minute hidden
    inside the load or the first answer."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return
    if native.needs_build():
        report("building kernels")
    native.status()


def _load_vision_model(display: str, folder: Path,
                       group: mx.distributed.Group | None) -> LoadedModel:
    """A vision-language model through mlx-vlm (engine/loading/vision.py): its language model in
    mlx-vlm's own layers (no CPU layout, no transform); never sharded."""
    from mlx_lm.utils import load_tokenizer

    from .vision import adapt_template, load_vision

    if group is not None:
        raise ModelLoadError(f"{display!r} is a vision model: sharded serving does not take vision "
                             "models; serve it on one process", code="vision_not_shardable")
    model, parts, config = load_vision(folder, display)
    tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    adapt_template(tokenizer)
    mx.eval(model.parameters())
    return LoadedModel(name=display, model=model, tokenizer=tokenizer, config=config, path=folder,
                       extras={"vision": parts})
