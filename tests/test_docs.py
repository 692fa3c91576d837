"""The documentation: every page is in the site's nav, the site builds with ``mkdocs build --strict``, and every
command in the README's figures table exists."""
import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def nav_pages(entries=None) -> list[str]:
    if entries is None:
        entries = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_every_page_is_in_the_nav():
    pages = nav_pages()
    assert len(pages) == len(set(pages)), "a page is in the nav twice"
    assert {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} <= set(pages)


def test_every_nav_page_exists():
    assert [p for p in nav_pages() if not (DOCS / p).exists()] == []


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="pip install '.[docs]'")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    config = load_config(str(ROOT / "mkdocs.yml"), docs_dir=str(docs), site_dir=str(tmp_path / "site"), strict=True)
    build(config)  # strict: any warning (a broken link, a page outside the nav) raises
    assert (tmp_path / "site" / "architecture" / "index.html").exists()


def figures_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]
    return [re.search(r"`([^`]+)`", row.split("|")[2]).group(1) for row in rows]


def test_every_figure_has_a_command_that_exists():
    commands = figures_commands()
    assert len(commands) >= 5
    targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
    for command in commands:
        if command.startswith("make "):
            assert command.split()[1] in targets, command
        else:
            module = re.fullmatch(r"python -m ([\w.]+)(?: .*)?", command)
            assert module, f"{command!r} is neither `make TARGET` nor `python -m MODULE ...`"
            assert importlib.util.find_spec(module.group(1)) is not None, command
