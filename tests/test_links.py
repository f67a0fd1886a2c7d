"""Every document and section kvmap cites exists: the relative links of README.md, docs/*.md and
traces/README.md (files, and `#anchor`s against GitHub's heading anchors), and every `docs/NAME.md` or
`README` section named in those documents, in `kvmap --help` and every command's `--help`, and in kvmap's own
strings (error messages and docstrings: `see docs/recording.md, 'Installing vLLM for the recorder'`)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvmap.cli.app import app, command_name

from .conftest import ROOT

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "traces" / "README.md"]

LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
# `docs/recording.md, 'Installing vLLM for the recorder'`, `README, "Recording traces"`, `README's "X"`
SECTION = re.compile(r"""(?P<doc>docs/[\w.-]+\.md|README(?:\.md)?)(?:'s)?,?\s+(?:section\s+)?(?P<q>["'])"""
                     r"""(?P<section>[^"'\n]{2,80})(?P=q)""")
DOC_FILE = re.compile(r"(?<![\w./-])(?P<doc>docs/[\w.-]+\.md)(?:#(?P<anchor>[\w-]+))?")
BARE_MD = re.compile(r"(?<![\w./-])(?P<doc>[\w-]+\.md)\b")  # a document named without its folder


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not `-` or `_`), spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def headings(doc: Path) -> tuple[list[str], set[str]]:
    """A markdown file's heading texts (code spans unwrapped) and their anchors (repeats get -1, -2, ...)."""
    texts, anchors, seen = [], set(), {}
    fenced = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} +(.+?) *#*$", line)
        if m:
            text = m.group(1).replace("`", "")
            texts.append(text)
            a = slug(text)
            n = seen.get(a, 0)
            seen[a] = n + 1
            anchors.add(a if n == 0 else f"{a}-{n}")
    return texts, anchors


def prose(doc: Path) -> str:
    """A markdown file without its code blocks (a link inside one is an example, not a link)."""
    return re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)


def check_anchor(doc: Path, anchor: str, where: str) -> list[str]:
    return [] if anchor in headings(doc)[1] else [f"{where}: {doc.relative_to(ROOT)} has no section #{anchor}"]


def check_citations(text: str, where: str) -> list[str]:
    """Every `docs/NAME.md` (and its #anchor), every bare `NAME.md` and every section named after a document in
    `text` exists."""
    text = " ".join(text.split())
    bad = []
    for m in DOC_FILE.finditer(text):
        doc = ROOT / m["doc"]
        if not doc.is_file():
            bad.append(f"{where}: cites {m['doc']}, which does not exist")
        elif m["anchor"]:
            bad += check_anchor(doc, m["anchor"], where)
    for m in BARE_MD.finditer(text):
        if not any((folder / m["doc"]).is_file() for folder in (ROOT, ROOT / "docs", ROOT / "traces")):
            bad.append(f"{where}: cites {m['doc']}, which is not in the repository")
    for m in SECTION.finditer(text):
        doc = ROOT / ("README.md" if m["doc"].startswith("README") else m["doc"])
        if doc.is_file() and m["section"].strip().rstrip(".") not in headings(doc)[0]:
            bad.append(f"{where}: {doc.relative_to(ROOT)} has no section {m['section']!r}")
    return bad


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    bad = []
    for m in LINK.finditer(prose(doc)):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{doc.relative_to(ROOT)}: link {target} points to nothing")
        elif anchor:
            bad += check_anchor(dest, anchor, f"{doc.relative_to(ROOT)}: link {target}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_document_and_section_a_document_names_exists(doc):
    bad = check_citations(prose(doc), str(doc.relative_to(ROOT)))
    assert not bad, "\n".join(bad)


def test_every_document_the_help_names_exists():
    runner = CliRunner()
    bad = []
    for args in [[]] + [[command_name(c)] for c in app.registered_commands]:
        res = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "400"}, prog_name="kvmap")
        assert res.exit_code == 0, res.output
        text = re.sub(r"[│╭╮╰╯─]", " ", res.stdout)  # the panels' borders
        assert "docs/" in text or args != ["replay"], "the test reads the help it means to read"
        bad += check_citations(text, f"kvmap {' '.join(args)} --help")
    assert not bad, "\n".join(bad)


def strings(path: Path):
    """Every string constant of a Python module (messages, docstrings), adjacent literals joined."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ".md" in node.value:
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if ".md" in text:
                yield node.lineno, text


def test_every_document_kvmaps_messages_and_docstrings_name_exists():
    bad = []
    for path in sorted((ROOT / "kvmap").rglob("*.py")):
        for line, text in strings(path):
            bad += check_citations(text, f"{path.relative_to(ROOT)}:{line}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_broken_link_and_a_missing_section(tmp_path):
    """The rules above, on text that breaks them."""
    assert slug("`kv_cache_groups` entries") == "kv_cache_groups-entries"
    assert slug("Header (line 1)") == "header-line-1"
    assert slug("What a worker must get right (vLLM 0.33)") == "what-a-worker-must-get-right-vllm-033"
    assert "recording-traces" in headings(ROOT / "README.md")[1]
    assert check_citations("see README, 'Recording traces'", "t") == []
    assert check_citations("see README, 'No such section'", "t") == ["t: README.md has no section 'No such section'"]
    assert check_citations("docs/nothing.md", "t") == ["t: cites docs/nothing.md, which does not exist"]
    assert check_citations("docs/recording.md#the-workload-file", "t") == []
    assert check_citations("docs/recording.md#nowhere", "t") == ["t: docs/recording.md has no section #nowhere"]
    assert check_citations("notes.md", "t") == ["t: cites notes.md, which is not in the repository"]


def test_the_readme_counts_validates_kinds():
    """The command table's count of problem kinds is `len(KINDS)` (it said 24 when there were 32)."""
    import re

    from kvmap.validate.problems import KINDS

    counts = re.findall(r"\((\d+) kinds:", (ROOT / "README.md").read_text())
    assert counts == [str(len(KINDS))], counts
