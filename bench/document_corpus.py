"""Documents for the document benchmark and tests (bench/documents.py, tests/test_documents_*.py,
e2e/test_documents.py): many-page PDFs written by hand (no PDF-writing library is installed), each
page showing its lines of text in Helvetica so that pypdf reads them back, and a report with one
planted fact among decoys."""

FONT = b"<</Type/Font/Subtype/Type1/BaseFont/Helvetica>>"


def pdf_file(objects: list[bytes]) -> bytes:
    """A PDF of `objects` (object 1 is the catalog), with a correct cross-reference table."""
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<</Size %d/Root 1 0 R>>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def stream(data: bytes) -> bytes:
    return b"<</Length %d>>stream\n" % len(data) + data + b"\nendstream"


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
