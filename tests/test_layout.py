"""The docs hold to the code: docs/layout.md's tree lists every module of the package and
nothing that is not there, and every config key the docs name (`section.key` in a code span)
is a key of the config."""

from __future__ import annotations

import re
from pathlib import Path

from supervisor.config.schema import SCHEMA

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FILE_ENDINGS = (".py", ".md", ".toml", ".json", ".jsonl", ".html", ".log", ".cfg", ".conf",
                ".sh", ".c", ".cpp", ".h", ".cu", ".txt")


def tree_listing() -> list[str]:
    """The paths docs/layout.md's tree names (folders with a trailing /), from its indented
    block under "### The tree": two spaces a level, the first word of each line."""
    text = (REPO / "docs" / "layout.md").read_text()
    block = text.split("### The tree", 1)[1].split("\n###", 1)[0]
    paths: list[str] = []
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        if not line.startswith("    ") or not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        name = line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(p for _, p in stack) + name
        paths.append(path)
        if name.endswith("/"):
            stack.append((indent, name))
    return paths


def test_the_layout_page_lists_every_module_and_only_what_exists() -> None:
    listed = tree_listing()
    assert "supervisor/policy/admission.py" in listed  # the parser reads the nesting
    missing = [p for p in listed if not (REPO / p).exists()]
    assert missing == [], f"docs/layout.md names what is not there: {missing}"
    modules = {str(p.relative_to(REPO)) for p in (REPO / "supervisor").rglob("*.py")}
    folders = {str(p.relative_to(REPO)) + "/" for p in (REPO / "supervisor").rglob("*")
               if p.is_dir() and p.name != "__pycache__"}
    unlisted = sorted((modules | folders) - set(listed))
    assert unlisted == [], f"docs/layout.md does not list: {unlisted}"


def named_keys(text: str) -> set[str]:
    """`section.key` in the code spans of a page (file names left out)."""
    found = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        for m in re.finditer(r"\b([a-z]+)\.([a-z_]+)\b", span):
            section, key = m.groups()
            if section in SCHEMA and not m.group(0).endswith(FILE_ENDINGS) \
                    and not span[m.end():].startswith(tuple(e[1:] for e in FILE_ENDINGS)):
                found.add(f"{section}.{key}")
    return found


def test_every_config_key_the_docs_name_exists() -> None:
    named = {page.name: named_keys(page.read_text()) for page in DOCS}
    assert sum(len(keys) for keys in named.values()) > 40  # the docs do name keys
    unknown = {page: sorted(k for k in keys if k.split(".")[1] not in SCHEMA[k.split(".")[0]])
               for page, keys in named.items()}
    assert {p: k for p, k in unknown.items() if k} == {}


def test_a_key_that_is_not_there_would_be_caught() -> None:
    assert named_keys("set `server.no_such_key` and `gpu.device`") == {
        "server.no_such_key", "gpu.device"}
    assert named_keys("the file `incidents.jsonl`, `policy.lifecycle`") == set()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_lands() -> None:
    """README.md and docs/*.md: each relative link names a file that exists, and an anchor
    that is one of its headings (the README was split into docs/ pages; nothing may dangle)."""
    broken = []
    for page in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"(?m)^#{1,6} (.+)$", file.read_text())
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target}")
    assert broken == []
