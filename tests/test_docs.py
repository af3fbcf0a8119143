"""The documentation stays navigable: a short README, links that resolve, papers cited by name.

* README.md is at most 250 lines (the user guide lives in docs/, the results in benchmarks/);
* every relative link in README.md, docs/*.md and benchmarks/README.md points at a file or folder
  that exists, and a ``#anchor`` into a markdown file names one of its headings (GitHub's slugs);
* README.md and docs/ cite papers by title or short name, never as "paper 00N".

Links inside code (fenced blocks, inline backticks) are text, not links, and are not checked.
"""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED = [README, *DOCS, ROOT / "benchmarks" / "README.md"]
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto: ...


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text with fenced code blocks and inline code removed."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, punctuation other than
    hyphens and underscores dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|\*|__)(.+?)\1", r"\2", text)  # emphasis markers are not text
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return LINK.findall(_prose(path.read_text(encoding="utf-8")))


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in links(path):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{target}: no such file ({_rel(dest) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and dest.is_file() and anchor not in anchors(dest):
            problems.append(f"{target}: {_rel(dest)} has no heading with the anchor #{anchor}")
    return problems


def test_the_pages_exist():
    assert README.is_file()
    assert (ROOT / "benchmarks" / "README.md").is_file()
    names = {p.name for p in DOCS}
    for page in (
        "install",
        "cli",
        "data",
        "recipes",
        "mixers",
        "methods",
        "generation",
        "serving",
        "evaluation",
        "python",
        "design",
    ):
        assert f"{page}.md" in names, f"docs/{page}.md is missing"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; move detail to docs/ or benchmarks/README.md"
    )


@pytest.mark.parametrize("path", LINKED, ids=_rel)
def test_relative_links_resolve(path):
    assert path.is_file(), f"{_rel(path)} is missing"
    problems = broken_links(path)
    assert not problems, f"{_rel(path)} has broken links:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("path", [README, *DOCS], ids=_rel)
def test_papers_are_cited_by_name(path):
    text = path.read_text(encoding="utf-8")
    hits = [m.group(0) for m in re.finditer(r"paper\s+00\d", text, re.IGNORECASE)]
    assert not hits, (
        f"{_rel(path)} cites papers by number ({', '.join(hits)}); use the short name (docs/methods.md)"
    )


# ---------------------------------------------------------------------------- the checker itself


def test_slug_follows_github():
    assert slug("The quality scoreboard") == "the-quality-scoreboard"
    assert slug("Speculative decoding (Mamba in the Llama §4)") == "speculative-decoding-mamba-in-the-llama-4"
    assert slug("`attn2ssm distill`: run a recipe") == "attn2ssm-distill-run-a-recipe"
    assert slug("mixed_precision and bf16") == "mixed_precision-and-bf16"
    assert slug("Serving: GGUF / llama.cpp") == "serving-gguf--llamacpp"
    assert slug("**Bold** words") == "bold-words"


def test_checker_finds_broken_links(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n## Two words\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](a.md) [ok](a.md#two-words) [ok](a.md#two-words-1) [ok](#here) [ok](https://x.org/none)\n"
        "`[code](missing.md)`\n```\n[fenced](missing.md)\n```\n"
        "## Here\n[bad](missing.md) [bad](a.md#nowhere) ![bad](img/none.png)\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert (
        any("missing.md" in p for p in problems)
        and any("#nowhere" in p for p in problems)
        and any("none.png" in p for p in problems)
    )
