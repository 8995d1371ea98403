"""The README a new user meets and the docs/ pages behind it: the two commands first, a short README, a
settings table equal to the code's settings, and no dead link or anchor between the pages."""

from __future__ import annotations

import re
from pathlib import Path

from eagle_tap.settings_table import settings_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SETTINGS_PAGE = DOCS / "settings.md"
README_MAX_LINES = 260

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[([^\]\n]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=[\"']([^\"']+)[\"']", re.I)


def pages() -> list[Path]:
    """Every Markdown page a reader follows links between."""
    return [README, *sorted(DOCS.rglob("*.md")), ROOT / "capture_format" / "README.md", ROOT / "docker" / "README.md"]


def _prose(text: str) -> str:
    """The text outside fenced code blocks, inline code spans blanked (neither holds links)."""
    return _INLINE_CODE.sub("code", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: link text kept, lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors a page defines: its headings' slugs (repeats numbered as GitHub does) and <a id/name>."""
    text = page.read_text(encoding="utf-8")
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        slug = github_slug(heading)
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found | set(_EXPLICIT_ANCHOR.findall(text))


def _shown(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def dead_links(page: Path) -> list[str]:
    """The relative links of a Markdown page whose file, or whose #anchor in that file, does not exist."""
    dead = []
    for _, target in _LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"(https?|mailto):", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            dead.append(f"{_shown(page)}: {target} (no such file)")
        elif anchor and (linked.is_dir() or anchor not in anchors(linked)):
            dead.append(f"{_shown(page)}: {target} (no heading or <a id> '{anchor}' in {_shown(linked)})")
    return dead


def test_the_first_commands_are_make_demo_and_make_test() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]


def test_readme_is_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move text into docs/"


def test_the_readme_links_every_docs_page() -> None:
    linked = {target.partition("#")[0] for _, target in _LINK.findall(_prose(README.read_text(encoding="utf-8")))}
    missing = [f"docs/{page.name}" for page in sorted(DOCS.glob("*.md")) if f"docs/{page.name}" not in linked]
    assert not missing, f"README.md links no line to {missing}"


def test_every_link_of_the_readme_and_docs_resolves(tmp_path: Path) -> None:
    # The checker itself must catch a dead file, a dead anchor and an anchor a heading no longer defines.
    (tmp_path / "a.md").write_text(
        "# Page A\n\n## Section: one `thing`\n\n<a id=\"kept\"></a>\n\n```bash\n# not a heading\n```\n\n"
        "[ok](b.md#other-section) [ok](#section-one-thing) [ok](#kept) [ok](https://example.com/x.md)\n"
        "[dead](missing.md) [dead](b.md#no-such-section) [dead](#not-a-heading)\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# Page B\n\n## Other section\n", encoding="utf-8")
    reported = dead_links(tmp_path / "a.md")
    assert [line.split(": ", 1)[1].split(" ")[0] for line in reported] == [
        "missing.md", "b.md#no-such-section", "#not-a-heading"], reported
    assert dead_links(tmp_path / "b.md") == []

    dead = [line for page in pages() for line in dead_links(page)]
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_the_settings_table_is_the_one_the_code_defines() -> None:
    text = SETTINGS_PAGE.read_text(encoding="utf-8")
    embedded = re.search(r"<!-- settings -->\n(.*?)\n<!-- /settings -->", text, re.S)
    assert embedded is not None, "docs/settings.md lacks the <!-- settings --> ... <!-- /settings --> block"
    assert embedded.group(1) == settings_table(), (
        "the settings table in docs/settings.md differs from the code's: regenerate it with "
        "`python -m eagle_tap.settings_table` and paste its output between the markers in docs/settings.md")


def test_every_setting_says_what_it_means() -> None:
    rows = settings_table().splitlines()[2:]
    assert len(rows) > 50
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert len(cells) == 4 and cells[3], row
