"""Every design reference resolves (issue 25): code, ``--help``, docs, Dockerfiles, compose and
Kubernetes files cite the design as ``docs/design.md §N`` (or ``§N.M``), and that section is
there; nothing cites a design document outside the repository ("DESIGN §7"); links into
design.md from the docs land on a heading."""

from __future__ import annotations

import re
from pathlib import Path

from repo_files import ROOT, text_files

DESIGN = ROOT / "docs" / "design.md"
HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? (.+)$", re.M)
_NUM = r"(\d+(?:\.\d+)*)"
_GAP = r"(?:\s|#|//|\*)*"  # a reference may wrap onto the next comment line
REFERENCE = re.compile(rf"docs/design\.md{_GAP}§{_NUM}((?:{_GAP}(?:,|and|or){_GAP}§{_NUM})*)")
MORE = re.compile(rf"§{_NUM}")
OUTSIDE = re.compile(rf"\bDESIGN(?:\.md)?\b{_GAP}(?:sections?\b|§)")
LINK = re.compile(r"\]\(((?:\.\./)?(?:docs/)?design\.md)#([\w-]+)\)")


def sections() -> dict[str, str]:
    """Section number -> title, from design.md's numbered headings (``## 3. Wire semantics``,
    ``### 3.4 Contributions``)."""
    found = {}
    for m in HEADING.finditer(DESIGN.read_text(encoding="utf-8")):
        found[m.group(1)] = m.group(2).strip()
    return found


def anchor(number: str, title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = f"{number} {title}".lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def references(text: str) -> list[str]:
    found = []
    for m in REFERENCE.finditer(text):
        found.append(m.group(1))
        found.extend(MORE.findall(m.group(2)))
    return found


def test_design_sections_are_numbered_in_order() -> None:
    numbers = list(sections())
    tops = [n for n in numbers if "." not in n]
    assert tops == [str(i) for i in range(1, len(tops) + 1)], tops
    assert len(tops) >= 7, tops
    for top in tops:
        subs = [n for n in numbers if n.startswith(f"{top}.")]
        assert subs == [f"{top}.{i}" for i in range(1, len(subs) + 1)], subs
    assert "The server's packages" in sections().values()


def test_the_patterns_find_references() -> None:
    text = "# docs/design.md §7.5: glibc\n(docs/design.md §5.2, §6.1) docs/design.md\n    # §3\n"
    assert references(text) == ["7.5", "5.2", "6.1", "3"]
    assert OUTSIDE.search("(DESIGN section 6)") and OUTSIDE.search("DESIGN\n    # section 7")
    assert OUTSIDE.search("DESIGN §7") and not OUTSIDE.search("docs/design.md §7")


def test_every_design_reference_names_a_section_that_exists() -> None:
    known = sections()
    here = Path(__file__).resolve()
    cited: dict[str, list[str]] = {}
    outside = []
    for path in text_files():
        if path == here:  # its examples are not references
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = str(path.relative_to(ROOT))
        for number in references(text):
            cited.setdefault(number, []).append(rel)
        for m in OUTSIDE.finditer(text):
            outside.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
    assert not outside, "cite docs/design.md §N instead of a design outside the repo:\n" + (
        "\n".join(outside)
    )
    assert len(cited) >= 10, f"found almost no references: {cited}"  # the scan itself works
    missing = {n: where for n, where in cited.items() if n not in known}
    assert not missing, f"docs/design.md has no such sections: {missing}"


def test_links_into_design_land_on_a_heading() -> None:
    anchors = {anchor(n, title) for n, title in sections().items()}
    assert "75-what-these-choices-rest-on" in anchors, sorted(anchors)
    links = []
    for path in text_files():
        if path.suffix == ".md":
            links += [(path, m.group(2)) for m in LINK.finditer(path.read_text(encoding="utf-8"))]
    assert links, "no links into docs/design.md found"
    broken = [f"{p.relative_to(ROOT)}: #{a}" for p, a in links if a not in anchors]
    assert not broken, f"links to headings design.md does not have: {broken}"
