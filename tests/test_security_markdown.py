"""Model output can never inject markup: markdown-it escapes raw HTML, nh3 filters what is left."""

from html.parser import HTMLParser

import pytest

from app.ui.markdown import render_markdown, render_plain

pytestmark = pytest.mark.fast

ATTACKS = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "<svg onload=alert(1)>",
    "<iframe src=javascript:alert(1)></iframe>",
    '<a href="javascript:alert(1)">click</a>',
    "[click](javascript:alert(1))",
    "[click](JaVaScRiPt:alert(1))",
    "[click](  javascript:alert(1))",
    "[click](vbscript:msgbox(1))",
    "[click](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
    "![x](javascript:alert(1))",
    '![x](https://tracker.example/p.png "t")',
    "<think><script>alert(1)</script></think>after",
    "<think>open <img src=x onerror=alert(1)>",
    "```\"><script>alert(1)</script>\n<script>alert(2)</script>\n```",
    "`<b onmouseover=alert(1)>x</b>`",
    "<style>body{display:none}</style>",
    '<form action="/c/1/delete" method="post"><button>x</button></form>',
    "<details open ontoggle=alert(1)>x</details>",
    "| <script>alert(1)</script> | b |\n|---|---|\n| <img src=x onerror=alert(1)> | 2 |",
    "&lt;script&gt;alert(1)&lt;/script&gt;",
    '| <td class="evil" style="x"> |\n|:--|\n| <th onclick=alert(1)> |',
]
ALIGN_CLASSES = {"align-left", "align-center", "align-right"}

SAFE_TAGS = {"p", "em", "strong", "code", "pre", "div", "button", "details", "summary", "a", "ul",
             "ol", "li", "blockquote", "table", "thead", "tbody", "tr", "th", "td", "br", "hr", "del",
             "s", "h1", "h2", "h3", "h4", "h5", "h6"}


class _Elements(HTMLParser):
    """The real elements and attributes a browser would build from the HTML."""

    def __init__(self, html: str):
        super().__init__()
        self.found: list[tuple[str, dict[str, str | None]]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))


@pytest.mark.parametrize("text", ATTACKS)
def test_model_output_cannot_inject(text):
    out = render_markdown(text)
    for tag, attrs in _Elements(out).found:
        assert tag in SAFE_TAGS, out
        assert not any(name.startswith("on") or name in ("src", "style") for name in attrs), out
        if tag in ("th", "td"):
            assert set((attrs.get("class") or "").split()) <= ALIGN_CLASSES, out
        href = attrs.get("href")
        assert href is None or href.startswith(("https:", "http:", "mailto:")), out


def test_escaped_attacks_still_show_as_text():
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in render_markdown("<script>alert(1)</script>")


def test_markdown_features_survive_sanitising():
    out = render_markdown("**bold** [site](https://example.org) `x`\n\n- item\n\n| a |\n|---|\n| 1 |")
    assert "<strong>bold</strong>" in out
    assert '<a href="https://example.org" rel="noopener noreferrer nofollow">site</a>' in out
    assert "<code>x</code>" in out and "<li>item</li>" in out and "<td>1</td>" in out


def test_table_column_alignment_survives_as_classes_not_inline_styles():
    """markdown-it writes `style="text-align:..."`, which the page's CSP would block."""
    cells = [(tag, attrs) for tag, attrs in
             _Elements(render_markdown("| a | b | c | d |\n|:--|--:|:-:|---|\n| 1 | 2 | 3 | 4 |")).found
             if tag in ("th", "td")]
    assert [attrs.get("class") for _, attrs in cells] == \
        ["align-left", "align-right", "align-center", None] * 2
    assert not any("style" in attrs for _, attrs in cells)


def test_code_blocks_get_a_copy_button_and_keep_their_text_escaped():
    out = render_markdown("```python\nif a < b:\n    print('<hi>')\n```")
    assert '<button type="button" class="copy"' in out
    assert '<code class="language-python">if a &lt; b:\n    print(\'&lt;hi&gt;\')\n</code>' in out


def test_think_blocks_are_collapsible_and_open_while_unfinished():
    done = render_markdown("<think>step *one*</think>The answer")
    assert done.startswith('<details class="think"><summary>Thinking</summary><p>step <em>one</em></p>')
    assert done.endswith("<p>The answer</p>\n")
    streaming = render_markdown("<think>still thinking")
    assert streaming.startswith('<details class="think" open')


def test_user_text_is_escaped_verbatim():
    assert render_plain("<b>hi</b> & *x*") == "&lt;b&gt;hi&lt;/b&gt; &amp; *x*"
