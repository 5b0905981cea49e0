"""A document larger than the context in a real Chromium against a real server (bundled model):
attach a 300-page PDF (its chip shows progress, then pages and tokens), ask, see the citation of
page 217 under the answer, open it to read the chunk, reload and find it still there."""

import re

from playwright.sync_api import Page, expect

from bench.document_corpus import FACT, FACT_PAGE, report_pdf
from chat_page import last, new_chat, send, wait_answer


def test_attach_a_large_pdf_ask_see_the_citation_open_it_and_reload(page: Page, server, shot):
    new_chat(page, max_tokens=8)
    page.set_input_files("#attach-file", files=[{"name": "report.pdf", "mimeType": "application/pdf",
                                                 "buffer": report_pdf(300)}])
    chip = page.locator("#attachments .chip.ready")
    expect(chip).to_contain_text(re.compile(r"report\.pdf · 300 pages · [\d,]+ tokens"))
    shot(page, "30-document-chip")
    send(page, "What is the vault access code for the Zephyr archive?")
    expect(last(page, "user").locator(".attachments .chip")).to_contain_text("report.pdf · 300 pages")
    answer = wait_answer(page)
    citation = answer.locator(".citations .citation").first
    expect(citation).to_contain_text(f"report.pdf, p. {FACT_PAGE}")
    text = citation.locator(".chunk-text")
    expect(text).to_be_hidden()
    citation.locator("summary").click()
    expect(text).to_contain_text(FACT)
    shot(page, "31-document-citation")
    page.reload()
    again = wait_answer(page).locator(".citations .citation").first
    expect(again).to_contain_text(f"report.pdf, p. {FACT_PAGE}")
    again.locator("summary").click()
    expect(again.locator(".chunk-text")).to_contain_text(FACT)
