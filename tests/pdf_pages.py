"""Many-page PDFs for the document tests and benchmark, written by hand (no PDF library writes
them here): each page shows its lines of text in Helvetica, and pypdf reads them back."""

from test_hostile_pdfs import FONT, pdf_file, stream


def _escape(line: str) -> str:
    return line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def pdf_of_pages(pages: list[list[str]]) -> bytes:
    """A PDF with one page per item of `pages`, each showing its lines (Latin-1 text) top down."""
    n = len(pages)
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(n))
    objects = [b"<</Type/Catalog/Pages 2 0 R>>",
               f"<</Type/Pages/Kids[{kids}]/Count {n}>>".encode(), FONT]
    for i, lines in enumerate(pages):
        body = "BT /F1 10 Tf 12 TL 40 780 Td " + " ".join(f"({_escape(line)}) Tj T*" for line in lines) + " ET"
        objects.append(f"<</Type/Page/Parent 2 0 R/MediaBox[0 0 612 800]/Contents {5 + 2 * i} 0 R"
                       f"/Resources<</Font<</F1 3 0 R>>>>>>".encode())
        objects.append(stream(body.encode("latin-1")))
    return pdf_file(objects)


FILLER = ("The committee reviewed the quarterly figures for the northern and southern regions. "
          "Shipping volumes rose slightly while warehouse costs stayed flat across the period.")
FACT = "The vault access code for the Zephyr archive is 7391 and it changes every spring."
FACT_PAGE = 217
DECOYS = {12: "The Zephyr archive has a blue door and a vault on the second floor.",
          88: "Access to the archive requires a badge; the code of conduct applies to visitors.",
          150: "Every spring the vault is cleaned and the archive is closed for a week.",
          290: "The Zephyr project code name was retired after the audit."}


def report_pdf(pages: int = 300) -> bytes:
    """`pages` pages of filler, the fact on page FACT_PAGE and decoys (same words, no fact)."""
    out = []
    for number in range(1, pages + 1):
        lines = [f"Report section {number}.", *FILLER.split(". ")[:2], ""]
        if number == FACT_PAGE:
            lines += [FACT]
        elif number in DECOYS:
            lines += [DECOYS[number]]
        out.append(lines)
    return pdf_of_pages(out)
