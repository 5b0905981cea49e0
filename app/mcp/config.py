"""`mcp.json` in the data folder: the MCP servers the chat may use, in the `mcpServers` format
Claude Desktop, LM Studio and Cursor write (an existing file can be pasted in as it is).

    {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {"KEY": "secret"}},
        "search": {"url": "https://example.com/mcp", "headers": {"X-Key": "secret"},
                   "token": "secret bearer token"},
        "calc": {"command": "python", "args": ["calc.py"], "trusted": true, "disabled": false}
    }}

A server is stdio (`command`, `args`, `env`, `cwd`) or streamable HTTP (`url`, `headers`, `token`
sent as `Authorization: Bearer`). mlxchat's own keys: `trusted` (its read-only tools run without
asking) and `disabled`. `env` values, `headers` values, `token` and a URL's user info and query
are secrets: `public()` is what pages may show, and nothing else of a server leaves this module
for a page, a log or an export.
"""

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

FILE_NAME = "mcp.json"
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,48}$")
MAX_FILE_BYTES = 256 * 1024


class ConfigError(ValueError):
    """mcp.json (or pasted text) that cannot be used; the message says where and why."""


@dataclass(frozen=True)
class ServerConfig:
    """One entry of `mcpServers`, checked."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    token: str | None = None
    trusted: bool = False
    disabled: bool = False

    @property
    def kind(self) -> str:
        return "stdio" if self.command else "http"

    def public(self) -> dict[str, Any]:
        """What a page may show: no env values, header values, token, URL user info or query."""
        shown: dict[str, Any] = {"name": self.name, "kind": self.kind, "trusted": self.trusted,
                                 "disabled": self.disabled}
        if self.command:
            shown.update(command=self.command, args=list(self.args), env_keys=sorted(self.env))
        else:
            parts = urlsplit(self.url or "")
            host = parts.hostname or ""
            netloc = host + (f":{parts.port}" if parts.port else "")
            shown.update(url=urlunsplit((parts.scheme, netloc, parts.path, "", "")),
                         header_keys=sorted(self.headers), token=bool(self.token))
        return shown

    def secrets(self) -> list[str]:
        """Every secret value of the entry (to take out of any text that may show it)."""
        found = [*self.env.values(), *self.headers.values(), self.token or ""]
        if self.url:
            parts = urlsplit(self.url)
            found += [parts.password or "", parts.username or "", parts.query]
            found += [v for pair in parts.query.split("&") for v in pair.split("=")[1:]]
        return sorted({s for s in found if len(s) >= 3}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        """`text` with the entry's secrets replaced by "***"."""
        for secret in self.secrets():
            text = text.replace(secret, "***")
        return text

    def to_json(self) -> dict[str, Any]:
        """The entry as mcp.json holds it (secrets included: for the file only)."""
        out: dict[str, Any] = {}
        if self.command:
            out["command"] = self.command
            if self.args:
                out["args"] = list(self.args)
            if self.env:
                out["env"] = dict(self.env)
            if self.cwd:
                out["cwd"] = self.cwd
        else:
            out["url"] = self.url
            if self.headers:
                out["headers"] = dict(self.headers)
            if self.token:
                out["token"] = self.token
        if self.trusted:
            out["trusted"] = True
        if self.disabled:
            out["disabled"] = True
        return out


def _strings(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in value.items()):
        raise ConfigError(f"{where} must be an object of strings")
    return dict(value)


def parse_server(name: Any, entry: Any) -> ServerConfig:
    """One `mcpServers` entry, checked; raises ConfigError naming it."""
    if not isinstance(name, str) or not NAME.match(name):
        raise ConfigError(f"server name {json.dumps(name)} must be 1-48 letters, digits, '_', "
                          "'.' or '-'")
    where = f"mcpServers.{name}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be an object")
    command, url = entry.get("command"), entry.get("url") or entry.get("serverUrl")
    if bool(command) == bool(url):
        raise ConfigError(f"{where} needs either 'command' (stdio) or 'url' (streamable HTTP)")
    for key in ("trusted", "disabled"):
        if not isinstance(entry.get(key, False), bool):
            raise ConfigError(f"{where}.{key} must be true or false")
    common = {"name": name, "trusted": entry.get("trusted", False),
              "disabled": entry.get("disabled", False)}
    return _stdio(entry, where, common) if command else _http(entry, where, common)


def _stdio(entry: dict[str, Any], where: str, common: dict[str, Any]) -> ServerConfig:
    command, args, cwd = entry["command"], entry.get("args", []), entry.get("cwd")
    if not isinstance(command, str) or not isinstance(args, list) or \
            not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where}: 'command' must be a string and 'args' a list of strings")
    if cwd is not None and not isinstance(cwd, str):
        raise ConfigError(f"{where}.cwd must be a string")
    return ServerConfig(command=command, args=tuple(args),
                        env=_strings(entry.get("env"), f"{where}.env"), cwd=cwd, **common)


def _http(entry: dict[str, Any], where: str, common: dict[str, Any]) -> ServerConfig:
    url, token = entry.get("url") or entry.get("serverUrl"), entry.get("token")
    if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https"):
        raise ConfigError(f"{where}.url must be an http:// or https:// URL")
    if token is not None and not isinstance(token, str):
        raise ConfigError(f"{where}.token must be a string")
    return ServerConfig(url=url, headers=_strings(entry.get("headers"), f"{where}.headers"),
                        token=token or None, **common)


def parse(text: str) -> dict[str, ServerConfig]:
    """The servers of an mcp.json text (`{"mcpServers": {...}}`, or the bare mapping)."""
    if len(text.encode()) > MAX_FILE_BYTES:
        raise ConfigError(f"mcp.json may hold at most {MAX_FILE_BYTES // 1024} KB")
    try:
        data = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError('mcp.json must be an object: {"mcpServers": {...}}')
    servers = data.get("mcpServers", data if "mcpServers" not in data and data else {})
    if not isinstance(servers, dict):
        raise ConfigError("'mcpServers' must be an object of servers by name")
    return {name: parse_server(name, entry) for name, entry in servers.items()}


def load(path: Path) -> dict[str, ServerConfig]:
    """The servers in the file at `path` (none when it does not exist); raises ConfigError."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read {path.name}: {exc.strerror or exc}") from None


def save(path: Path, servers: dict[str, ServerConfig]) -> None:
    """Write the servers to `path` atomically, readable by its owner only (it holds secrets)."""
    text = json.dumps({"mcpServers": {n: s.to_json() for n, s in servers.items()}}, indent=2)
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
