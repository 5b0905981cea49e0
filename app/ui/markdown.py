"""Model output to safe HTML: markdown-it-py with raw HTML disabled, then nh3 as a second wall.

Model text is untrusted. markdown-it escapes any HTML in it and refuses `javascript:`-style links;
nh3 then keeps only an allow-list of tags, attributes and URL schemes, so even a markdown-it bug
cannot let script, event handlers or dangerous URLs through. We add two things ourselves, after
escaping: a copy button on each code block and a collapsible block for `<think>` reasoning. Tool
calls and tool results are never markdown: escaped text in collapsible blocks.

A table column's alignment (`|:--|--:|`), which markdown-it writes as `style="text-align:..."`,
becomes one of three classes: the page's CSP allows no inline style, and nh3 keeps only those.
"""

import html
import json
import re

import nh3
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml

_THINK = re.compile(r"<think>(.*?)(</think>|$)", re.DOTALL)
_ALIGN = re.compile(r"text-align:(left|center|right)")
_ALIGN_CLASSES = {"align-left", "align-center", "align-right"}

# No images: a remote image in model output would leak that the chat happened.
_TAGS = (set(nh3.ALLOWED_TAGS) - {"img", "map", "area"}) | {"button"}
_ATTRIBUTES = {
    "a": {"href", "title"},
    "code": {"class"},
    "div": {"class"},
    "details": {"class", "open"},
    "button": {"class", "type", "aria-label"},
    "ol": {"start"},
}
# The only classes nh3 keeps on table cells (nh3 wants them here, not in _ATTRIBUTES).
_CLASSES = {"th": _ALIGN_CLASSES, "td": _ALIGN_CLASSES}


def _fence(renderer, tokens, idx, options, env) -> str:
    token = tokens[idx]
    lang = token.info.strip().split(maxsplit=1)[0] if token.info.strip() else ""
    cls = f' class="language-{escapeHtml(lang)}"' if lang else ""
    return (
        '<div class="code"><button type="button" class="copy" aria-label="Copy code">Copy</button>'
        f"<pre><code{cls}>{escapeHtml(token.content)}</code></pre></div>\n"
    )


def _cell(renderer, tokens, idx, options, env) -> str:
    """A table cell with its column's alignment as a class instead of an inline style."""
    token = tokens[idx]
    align = _ALIGN.fullmatch(str(token.attrs.pop("style", "")))
    if align:
        token.attrSet("class", f"align-{align.group(1)}")
    return renderer.renderToken(tokens, idx, options, env)


_md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable(["table", "strikethrough"])
_md.add_render_rule("fence", _fence)
_md.add_render_rule("code_block", _fence)
_md.add_render_rule("th_open", _cell)
_md.add_render_rule("td_open", _cell)


def _clean(fragment: str) -> str:
    return nh3.clean(
        fragment, tags=_TAGS, attributes=_ATTRIBUTES, allowed_classes=_CLASSES,
        url_schemes={"http", "https", "mailto"}, link_rel="noopener noreferrer nofollow",
    )


def render_markdown(text: str) -> str:
    """Sanitised HTML for `text`; `<think>...</think>` becomes a collapsible details block.

    An unclosed `<think>` (the model is still reasoning) renders open, so streamed thoughts show.
    """
    parts: list[str] = []
    pos = 0
    for match in _THINK.finditer(text):
        parts.append(_md.render(text[pos:match.start()]))
        thought, closed = match.group(1), bool(match.group(2))
        parts.append(
            f'<details class="think"{"" if closed else " open"}><summary>Thinking</summary>'
            f"{_md.render(thought)}</details>"
        )
        pos = match.end()
    parts.append(_md.render(text[pos:]))
    return _clean("".join(parts))


def _pretty(arguments: object) -> str:
    """Tool arguments as indented JSON where they parse, else as they came."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return str(arguments)
    return json.dumps(value, indent=2, ensure_ascii=False)


def render_tool_calls(calls: list[dict], servers: dict | None = None) -> str:
    """An answer's tool calls, each a collapsed block: the function's name (and the MCP server it
    belongs to, from `servers`: call id -> {"server", "tool"}), its arguments."""
    blocks = []
    servers = servers if isinstance(servers, dict) else {}  # an imported file may hold anything
    for call in calls:
        fn = call.get("function") or {}
        where = servers.get(call.get("id")) if isinstance(call.get("id"), str) else None
        where = where if isinstance(where, dict) else {}
        name = where.get("tool") or fn.get("name")
        on = f' on <span class="server">{html.escape(str(where["server"]))}</span>' \
            if where.get("server") else ""
        blocks.append(
            f'<details class="tool-call"><summary>Tool call: <code>{html.escape(str(name))}'
            f'</code>{on}</summary><pre><code>{html.escape(_pretty(fn.get("arguments")))}</code></pre></details>')
    return _clean("".join(blocks))


def render_tool_result(text: str, call_id: str | None, meta: dict | None = None) -> str:
    """A tool's result as a collapsed block of plain text, whatever it holds; `meta` (MCP) names
    the tool and says how the call ended ("error", "denied", "stopped") and if it was cut."""
    meta = meta if isinstance(meta, dict) else {}
    if meta.get("tool"):
        label = f"Result of <code>{html.escape(str(meta['tool']))}</code>"
        outcome = str(meta.get("outcome") or "done")
        if outcome != "done":
            label += f' <span class="outcome">({html.escape(outcome)})</span>'
        if meta.get("truncated"):
            label += ' <span class="outcome">(truncated)</span>'
    else:
        label = f"Tool result <code>{html.escape(call_id)}</code>" if call_id else "Tool result"
    return _clean(f'<details class="tool-result"><summary>{label}</summary>'
                  f"<pre>{html.escape(text)}</pre></details>")


def render_plain(text: str) -> str:
    """User messages are shown as typed: escaped, line breaks kept by CSS."""
    return html.escape(text)
