"""The documents hold together: every link and image in README.md, docs/*.md and slurm/README.md resolves, the README
stays a front door (short, the two fresh-machine commands first, and those are the commands CI and the Makefile run),
and docs/index.md lists every page.

A relative link must name a file or folder of the repository; a ``#fragment`` must match a heading of the target
Markdown file by GitHub's rule (lower case, punctuation other than ``-`` and ``_`` removed, spaces to ``-``, ``-1``,
``-2``, ... for repeated headings); an image must exist. External links are only checked to be well-formed (no
network). Links inside code blocks and code spans are text, not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [README, *DOCS, ROOT / "slurm" / "README.md"]
README_MAX_LINES = 260
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", flags=re.S)
# [text](target) and ![alt](target), with an optional "title"; the text may hold one level of brackets and line breaks
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose(text: str) -> list[tuple[int, str]]:
    """(first line number, paragraph) of the text outside fenced code blocks, code spans removed."""
    paragraphs, current, start, fenced = [], [], 1, None
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if fenced:
            if fence and fence.group(1) == fenced:
                fenced = None
            continue
        if fence:
            fenced = fence.group(1)
        if fence or not line.strip():
            if current:
                paragraphs.append((start, "\n".join(current)))
            current = []
            continue
        if not current:
            start = number
        current.append(line)
    if current:
        paragraphs.append((start, "\n".join(current)))
    return [(n, CODE_SPAN.sub("", p)) for n, p in paragraphs]


def links(text: str) -> list[tuple[int, bool, str]]:
    """(line, is an image, target) of every link and image of a Markdown text."""
    out = []
    for start, paragraph in prose(text):
        for match in LINK.finditer(paragraph):
            line = start + paragraph[:match.start()].count("\n")
            out.append((line, match.group(1) == "!", match.group(3).strip("<>")))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: markup dropped (code, emphasis, link targets), lower case, every
    character but letters, digits, spaces, '-' and '_' removed, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown text's headings (outside code blocks), repeated ones numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    fenced = None
    for line in text.splitlines():
        fence = FENCE.match(line)
        if fenced:
            fenced = None if fence and fence.group(1) == fenced else fenced
            continue
        if fence:
            fenced = fence.group(1)
            continue
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def problems(document: Path, root: Path = ROOT) -> list[str]:
    """What does not resolve in ``document``: one line per broken link or image."""
    found = []
    text = document.read_text()
    where = document.relative_to(root)
    for line, image, target in links(text):
        kind = "image" if image else "link"
        url = urlparse(target)
        if url.scheme in ("http", "https"):
            if not url.netloc or " " in target or "." not in url.netloc:
                found.append(f"{where}:{line}: malformed {kind} {target}")
            elif image:
                found.append(f"{where}:{line}: image {target} is not in the repository")
            continue
        if url.scheme or url.netloc:
            found.append(f"{where}:{line}: {kind} {target}: only relative paths, #anchors and http(s) links")
            continue
        path_part, _, fragment = target.partition("#")
        path = (document.parent / unquote(path_part)).resolve() if path_part else document
        if path_part and (root not in path.parents and path != root):
            found.append(f"{where}:{line}: {kind} {target} leaves the repository")
            continue
        if not path.exists():
            found.append(f"{where}:{line}: {kind} {target}: {path.relative_to(root)} does not exist")
            continue
        if image and not path.is_file():
            found.append(f"{where}:{line}: image {target} is not a file")
            continue
        if fragment:
            if path.suffix != ".md" or not path.is_file():
                found.append(f"{where}:{line}: {kind} {target}: an anchor needs a Markdown file")
            elif unquote(fragment) not in anchors(path.read_text()):
                found.append(f"{where}:{line}: {kind} {target}: no heading of {path.relative_to(root)} has the "
                             f"anchor #{fragment}")
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(d.relative_to(ROOT)) for d in DOCUMENTS])
def test_every_link_and_image_resolves(document):
    assert problems(document) == []


def test_the_documents_link_to_each_other():
    """The checks above see the links (a parser that found none would pass everything)."""
    assert len(DOCS) >= 15
    targets = [t for _, _, t in links(README.read_text())]
    assert "docs/index.md" in targets and any("#" in t for d in DOCS for _, _, t in links(d.read_text()))
    assert any(image for d in DOCS for _, image, _ in links(d.read_text()))


def test_the_index_lists_every_page():
    listed = {t.partition("#")[0] for _, _, t in links((ROOT / "docs" / "index.md").read_text())}
    assert {d.name for d in DOCS} - {"index.md"} <= listed


def test_a_broken_link_an_unknown_anchor_and_a_missing_image_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## The run folder: `status.json`\n")
    doc = tmp_path / "README.md"
    doc.write_text("# Title\n\n## Quick start, again\n\n"
                   "[ok](docs/page.md#the-run-folder-statusjson) [ok](#quick-start-again) [web](https://example.org/x)\n"
                   "[gone](docs/missing.md) [bad anchor](docs/page.md#no-such-heading) ![img](docs/figures/none.png)\n"
                   "[split\nover lines](docs/also-missing.md) [bad url](https://) `[in code](nowhere.md)`\n\n"
                   "```\n[in a block](nowhere.md)\n```\n")
    found = problems(doc, tmp_path)
    assert len(found) == 5, found
    assert [f.split(":")[1] for f in found] == ["6", "6", "6", "7", "8"]
    assert "missing.md" in found[0] and "#no-such-heading" in found[1] and "none.png" in found[2]
    assert "also-missing.md" in found[3] and "malformed" in found[4]


def test_slugs_follow_githubs_rule():
    assert slug("5. Preemption, time limits and requeues") == "5-preemption-time-limits-and-requeues"
    assert slug("Checking a GPU node: `make gpu-check`") == "checking-a-gpu-node-make-gpu-check"
    assert slug("PL-RPC's aggregation converges") == "pl-rpcs-aggregation-converges"
    assert slug("RewardBench scoring (paper Appendix B.4)") == "rewardbench-scoring-paper-appendix-b4"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def quick_start_commands() -> list[str]:
    """The commands of the README's first code block (the Quick start), without their comments."""
    text = README.read_text()
    block = text[text.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("```")]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_starts_with_the_commands_that_ci_and_the_makefile_run():
    assert quick_start_commands() == ["make demo", "make test"]
    first_screen = "\n".join(README.read_text().splitlines()[:50])
    assert "make demo " in first_screen and "make test " in first_screen
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", makefile, flags=re.M))
    assert {"demo", "test", "demo-check"} <= targets
    demo_recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "train.py" in demo_recipe  # make demo is `python train.py`, the run the README's table comes from
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert "make test" in ci  # CI runs the README's test command as written
    assert "make demo-check" in ci  # and the README's demo, compared with its table
