"""axe-core's accessibility rules (WCAG 2 A/AA and best practices) on a page as it is now, through
axe-playwright-python (axe.min.js injected by Playwright, so the page's CSP is unchanged)."""

from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import Page

_axe = Axe()


def violations(page: Page, within: str | None = None) -> list[str]:
    """Each rule the page (or the part `within` selects) breaks: its id, impact and where."""
    results = _axe.run(page, context=within)
    return [f"{v['id']} ({v['impact']}): {v['help']} at "
            + ", ".join(" ".join(n["target"]) for n in v["nodes"][:3])
            for v in results.response["violations"]]
