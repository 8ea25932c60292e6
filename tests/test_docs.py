"""README.md and docs/: every relative link resolves, and the README keeps its two set-up commands.

No TensorFlow import: the pages are read as text. Anchors are resolved the way GitHub
makes them from headings (lower case, punctuation dropped, spaces to hyphens, repeats
numbered -1, -2, ...).
"""

import collections
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TRAIN_COMMAND = "python3 -m venv .venv && . .venv/bin/activate && pip install . && tfdist-train"
TEST_COMMAND = "python3 -m pip install nox && python3 -m nox"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _prose(path: pathlib.Path) -> str:
    """The page without its fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text()))


def anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    seen: collections.Counter = collections.Counter()
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", FENCE.sub("", path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def relative_links(path: pathlib.Path) -> list[str]:
    return [target for target in LINK.findall(_prose(path))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked.


def test_the_slugs_are_githubs():
    page = ROOT / "README.md"
    assert "use-it-from-python-tfdistfit" in anchors(page)
    assert "what-differs-from-modelfit" in anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target} (no {resolved.relative_to(ROOT) if ROOT in resolved.parents else resolved})")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_every_docs_page_is_linked_from_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in relative_links(index)}
    missing = [p.name for p in PAGES[1:] if p != index and p.resolve() not in linked]
    assert not missing, f"docs/README.md does not link {missing}"


def test_the_readme_keeps_its_two_set_up_commands():
    blocks = re.findall(r"^```sh\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    commands = [line.strip() for block in blocks for line in block.splitlines()]
    assert TRAIN_COMMAND in commands
    assert TEST_COMMAND in commands


def test_ci_runs_exactly_the_readmes_test_command():
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_layout_names_every_training_and_distribute_module_and_each_path_it_gives_exists():
    """docs/layout.md: a module added or moved without it fails here; so does an answer naming a missing file."""
    layout = (ROOT / "docs" / "layout.md").read_text()
    tree = FENCE.search(layout).group(0)
    for package in ("training", "distribute"):
        for module in sorted((ROOT / "tfdist" / package).glob("*.py")):
            if module.name != "__init__.py":
                assert re.search(rf"^ +{re.escape(module.name)} ", tree, re.M), f"{package}/{module.name}"
    named = re.findall(r"`(tfdist/[\w/]+\.py)`", layout.split("## Where does X happen")[1])
    assert len(named) >= 15 and all((ROOT / path).is_file() for path in named), named
