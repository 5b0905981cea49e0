"""`mlxchat launch claude|codex [-- CLIENT ARGS]`: run a coding agent against this machine's
mlxchat, configured for this one run only.

It finds mlxchat at `--url` (default http://127.0.0.1:8321; its `/health`), or starts one there
(`mlxchat serve --no-browser`, on `--model`) and stops it when the client exits. The client gets
the model's name and context length from `/v1/models`, and everything it needs through its own
per-run overrides: environment variables and command-line options, printed before it starts. The
user's own configuration files (`~/.claude/settings.json`, `~/.claude.json`, `~/.codex/config.toml`)
are never written.

- Claude Code: `ANTHROPIC_BASE_URL`, the key as `ANTHROPIC_AUTH_TOKEN` (a bearer token;
  `ANTHROPIC_API_KEY` emptied, so a real key is never sent here nor asked about), the model in its
  three slots (`ANTHROPIC_MODEL`, the main one, and `ANTHROPIC_DEFAULT_SONNET_MODEL` and
  `..._HAIKU_MODEL`, which its subagents and small tasks use), `CLAUDE_CODE_ATTRIBUTION_HEADER=0`
  (no billing line whose value changes every request, which would make every round cold) and
  `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1` (nothing sent elsewhere). Not the Opus slot
  (`ANTHROPIC_DEFAULT_OPUS_MODEL`): naming a model it does not know there, Claude Code 2.1.332
  rewrites a user's `"model": "opus"` in ~/.claude/settings.json to `"opus[1m]"`. (Any model name
  a client sends runs on the loaded model anyway.)
- Codex CLI: `-c` overrides for a `model_providers.mlxchat` entry (`base_url`, `wire_api =
  "responses"`, `env_key` when mlxchat has a key), `model_provider`, `model`,
  `model_context_window` and `model_auto_compact_token_limit` (so it compacts before the context
  is full).

A client's full prompt takes room (`Client.full_context`: Claude Code's ~12,200 tokens with its
tools, Codex's ~9,000, counted with the bundled model's tokenizer). On a model whose context is
smaller than that plus room to work, the client runs lean, and says so: `claude --bare` (the tools
Bash, Edit and Read, no CLAUDE.md, hooks or plugins), Codex without its multi-agent, goal and web
search tools. `--full` runs it whole anyway.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click
import httpx

DEFAULT_URL = "http://127.0.0.1:8321"
START_TIMEOUT_S = 600.0  # a first start may convert the bundled model or build the CPU kernels
AUTO_COMPACT_FRACTION = 0.8  # Codex compacts when the conversation reaches this much of the context


@dataclass(frozen=True)
class Server:
    """The mlxchat a client runs against: its URL, key, model and that model's context length."""

    url: str
    key: str | None
    model: str
    context: int | None


@dataclass(frozen=True)
class Client:
    """A coding agent: its executable, how to install it, the context its full prompt needs, and
    its per-run settings for a server (`settings(server, lean)`: environment and arguments)."""

    name: str
    title: str
    command: str
    package: str
    full_context: int
    settings: Callable[[Server, bool], tuple[dict[str, str], list[str]]]


def _claude(server: Server, lean: bool) -> tuple[dict[str, str], list[str]]:
    env = {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_AUTH_TOKEN": server.key or "mlxchat",
           "ANTHROPIC_API_KEY": "",
           "ANTHROPIC_MODEL": server.model,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": server.model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": server.model,
           "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    return env, ["--bare"] if lean else []


def _toml(value: Any) -> str:
    """A value as TOML writes it (strings quoted; JSON's string escapes are TOML's)."""
    return json.dumps(value) if isinstance(value, str) else str(value).lower() \
        if isinstance(value, bool) else str(value)


def _codex(server: Server, lean: bool) -> tuple[dict[str, str], list[str]]:
    provider = {"name": "mlxchat", "base_url": f"{server.url}/v1", "wire_api": "responses"}
    env = {}
    if server.key:
        provider["env_key"] = "MLXCHAT_API_KEY"
        env["MLXCHAT_API_KEY"] = server.key
    overrides: dict[str, Any] = {"model_provider": "mlxchat", "model": server.model,
                                 **{f"model_providers.mlxchat.{k}": v for k, v in provider.items()}}
    if server.context:
        overrides["model_context_window"] = server.context
        overrides["model_auto_compact_token_limit"] = int(server.context * AUTO_COMPACT_FRACTION)
    if lean:
        overrides.update({"features.multi_agent": False, "features.goals": False,
                          "web_search": "disabled"})
    args = [a for k, v in overrides.items() for a in ("-c", f"{k}={_toml(v)}")]
    return env, args


CLIENTS = {
    "claude": Client("claude", "Claude Code", "claude", "@anthropic-ai/claude-code", 20_000,
                     _claude),
    "codex": Client("codex", "Codex CLI", "codex", "@openai/codex", 16_000, _codex),
}


class LaunchError(click.ClickException):
    """Why the client could not be started, as one line."""


def _health(url: str) -> dict[str, Any] | None:
    """mlxchat's `/health` at `url`; None when nothing answers. LaunchError when something
    else does."""
    try:
        r = httpx.get(f"{url}/health", timeout=3)
    except httpx.HTTPError:
        return None
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "generating" not in body or "status" not in body:
        raise LaunchError(f"something other than mlxchat answers at {url}; choose another --url")
    return body


def _tail(log: Path | None, lines: int = 5) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines() if log else []
    except OSError:
        text = []
    return (": " + " / ".join(text[-lines:])) if text else ""


def _wait(url: str, alive: Callable[[], bool], log: Path | None = None,
          timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
    """`/health` once mlxchat at `url` serves; LaunchError when it stops or fails first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise LaunchError(f"the mlxchat it started stopped{_tail(log)}")
        health = _health(url)
        if health is not None and health["status"] == "ok":
            return health
        if health is not None and health["status"] == "failed":
            raise LaunchError(f"mlxchat at {url} failed: {health.get('error')}")
        time.sleep(0.5)
    raise LaunchError(f"mlxchat did not start at {url} in {timeout:.0f} s")


def _start(url: str, model: str | None, key: str | None, log: Path) -> subprocess.Popen:
    """`mlxchat serve` on the URL's port, its output into `log`."""
    port = httpx.URL(url).port or 8321
    host = httpx.URL(url).host or "127.0.0.1"
    command = [sys.executable, "-m", "app.cli", "serve", "--no-browser", "--host", host,
               "--port", str(port), *(["--model", model] if model else [])]
    click.echo(f"Starting mlxchat at {url} on {model or 'the bundled model'} "
               f"(its log: {log}) ...", err=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **({"MLXCHAT_API_KEY": key} if key else {})}
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _model_entry(url: str, key: str | None, model: str) -> dict[str, Any] | None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    if r.status_code == 401:
        raise LaunchError(f"mlxchat at {url} needs its API key: pass --api-key or set "
                          "MLXCHAT_API_KEY")
    r.raise_for_status()
    return next((m for m in r.json().get("data", []) if m.get("id") == model), None)


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _shown(key: str, value: str, secret: str | None) -> str:
    return f"{key}={'<the API key>' if secret and value == secret else shlex.quote(value)}"


def run_client(client: Client, server: Server, args: list[str], full: bool) -> int:
    """Run `client` against `server` with `args` after its own; its exit status."""
    executable = shutil.which(client.command)
    if executable is None:
        raise LaunchError(f"{client.title} is not installed: npm install -g {client.package}")
    lean = not full and server.context is not None and server.context < client.full_context
    env, options = client.settings(server, lean)
    context = f"{server.context:,} tokens" if server.context else "unknown"
    click.echo(f"Running {client.title} against {server.url} (model {server.model}, context "
               f"{context}); for this run only:", err=True)
    for k, v in env.items():
        click.echo(f"  {_shown(k, v, server.key)}", err=True)
    if options:
        click.echo(f"  {client.command} {shlex.join(options)}", err=True)
    if lean:
        click.echo(f"  (lean: the context is under the {client.full_context:,} tokens the full "
                   f"{client.title} needs; --full runs it whole)", err=True)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's
    try:
        return subprocess.call([executable, *options, *args], env={**os.environ, **env})
    finally:
        signal.signal(signal.SIGINT, previous)


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("client", type=click.Choice(sorted(CLIENTS)))
@click.argument("client_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--url", default=DEFAULT_URL, show_default=True,
              help="The mlxchat to use; one is started there when none answers.")
@click.option("--model", "-m", help="The model the client runs on (default: the loaded one; "
                                    "a started mlxchat loads it).")
@click.option("--api-key", envvar="MLXCHAT_API_KEY", help="mlxchat's API key, if it has one.")
@click.option("--full", is_flag=True, help="Run the client whole even on a model whose context "
                                           "is too small for its full prompt.")
def launch(client: str, client_args: tuple[str, ...], url: str, model: str | None,
           api_key: str | None, full: bool) -> None:
    """Run a coding agent (CLIENT: claude or codex) against mlxchat; arguments after `--` go to
    the client, e.g. `mlxchat launch claude -- -p "Say hello"`. Nothing in your own
    configuration files changes: the settings are for this run only and are printed."""
    from engine import data_dir

    url = url.rstrip("/")
    child = None
    # SIGTERM ends launch as Ctrl-C ends the client: through `finally`, which stops a server
    # it started (that server runs in a session of its own, out of the terminal's signals)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        health = _health(url)
        if health is None:
            log = data_dir() / "launch-server.log"
            child = _start(url, model, api_key, log)
            health = _wait(url, lambda: child.poll() is None, log)
        elif health["status"] != "ok":
            health = _wait(url, lambda: True)
        # one it started runs the model it was given (a name, a folder, a GGUF file)
        name = health["model"] if child is not None or not model else model
        entry = _model_entry(url, api_key, name)
        if entry is None:
            raise LaunchError(f"mlxchat at {url} has no model {name!r} (see `mlxchat models`)")
        server = Server(url, api_key, name, entry.get("context_length"))
        code = run_client(CLIENTS[client], server, list(client_args), full)
    finally:
        if child is not None:
            click.echo("Stopping the mlxchat it started ...", err=True)
            _stop(child)
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    sys.exit(code)
