"""Every ``docs/<file>.md §N`` citation in the repository points at a numbered heading that exists.

Docstrings, comments, configs and docs cite the design by section (``docs/README.md``). These tests read
every file git tracks (or would track: untracked files it does not ignore), parse the citations, and fail
naming the file, the line and the citation whose file or heading is missing. They also fail on a citation
of notes that live outside the repository, which a user who clones the project cannot open, and on
references to how the project was developed (work sessions, tracker numbers), which mean nothing to one.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SCANNED_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg", ".txt"}
SCANNED_NAMES = {"Makefile"}

_NUMBER = r"\d+(?:\.\d+)*"
# ``docs/design.md §3``, ``docs/design.md §1.3, §3``, ``docs/engines.md §3 and §5`` (backticks allowed).
CITATION = re.compile(rf"docs/([\w.-]+\.md)((?:[`\s,]*(?:(?:and|or)\s+)?§\s?{_NUMBER})+)")
SECTION = re.compile(rf"§\s?({_NUMBER})")
# ``## 3. Title`` / ``### 3.2 Title``: the level is one more than the number of components.
HEADING = re.compile(rf"^(#{{2,6}})\s+({_NUMBER})\.?\s+\S")
FENCE = re.compile(r"^\s*(```|~~~)")
# Citations of the notes kept outside the repository. The names are split so this file does not match.
FORBIDDEN = re.compile(
    "|".join(
        [
            r"\bDES" r"IGN(?:\.md)?\s*§",  # a section of the design notes
            r"\bDES" r"IGN\.md",  # the notes file itself
            r"\bSTY" r"LE(?:\.md|\s+habit)",  # the style notes
            r"engine-api" r"s\.md",  # the researched engine notes
            r"\bshared" r"/",  # anything under the shared folder beside the checkout
        ]
    )
)


def repo_files() -> list[Path]:
    """Text files git tracks or would track (ignored paths such as .venv, runs and assets excluded).

    This file is left out: its examples of citations are not citations.
    """
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    paths = {ROOT / p for p in out.split("\0") if p}
    return sorted(
        p
        for p in paths
        if p.is_file()
        and not p.is_symlink()
        and p != Path(__file__).resolve()
        and (p.suffix in SCANNED_SUFFIXES or p.name in SCANNED_NAMES)
    )


def parse_citations(text: str) -> list[tuple[int, str, str, tuple[int, int]]]:
    """``(line, file, section, span)`` of every docs citation in ``text``; one entry per cited section."""
    found = []
    for m in CITATION.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        for number in SECTION.findall(m.group(2)):
            found.append((line, m.group(1), number, m.span()))
    return found


def numbered_headings(text: str) -> list[tuple[int, int, str]]:
    """``(line, level, number)`` of every numbered markdown heading outside code fences."""
    headings, in_fence = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = HEADING.match(line)
        if m and not in_fence:
            headings.append((i, len(m.group(1)), m.group(2)))
    return headings


def sections(doc: Path) -> set[str]:
    return {number for _, _, number in numbered_headings(doc.read_text())}


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


# ------------------------------------------------------------------------------------------- the parser


def test_parser_reads_lists_of_sections_and_stops_at_prose() -> None:
    text = "see docs/design.md §1.3, §3 and §4.\nthen `docs/engines.md §5`, §6; later §7\ndocs/x.md has none"
    assert [(line, f, n) for line, f, n, _ in parse_citations(text)] == [
        (1, "design.md", "1.3"),
        (1, "design.md", "3"),
        (1, "design.md", "4"),
        (2, "engines.md", "5"),
        (2, "engines.md", "6"),
    ]


def test_heading_parser_skips_code_fences_and_unnumbered_headings() -> None:
    text = "# Title\n## 1. One\n### 1.2 Sub\n```\n## 9. Not a heading\n```\n## Notes\n#### 1.2.3. Deep\n"
    assert numbered_headings(text) == [(2, 2, "1"), (3, 3, "1.2"), (8, 4, "1.2.3")]


# ---------------------------------------------------------------------------------------- the repository


def test_the_code_cites_the_docs() -> None:
    """Guards against a parser that finds nothing, which would let every other test here pass."""
    cited = {(_rel(p), f"{f} §{n}") for p in repo_files() for _, f, n, _ in parse_citations(p.read_text())}
    assert ("buffer/schema.py", "design.md §2") in cited
    assert ("learner/checkpoint.py", "design.md §6.2") in cited
    assert len(cited) >= 20


def test_every_docs_citation_resolves_to_an_existing_heading() -> None:
    missing = []
    for path in repo_files():
        for line, doc, number, _ in parse_citations(path.read_text()):
            target = DOCS / doc
            if not target.is_file():
                missing.append(f"{_rel(path)}:{line}: docs/{doc} §{number}: no such file")
            elif number not in sections(target):
                missing.append(f"{_rel(path)}:{line}: docs/{doc} §{number}: no heading numbered {number}")
    assert not missing, "citations that do not resolve:\n" + "\n".join(missing)


def test_bare_section_references_inside_docs_resolve_in_the_same_file() -> None:
    missing = []
    for doc in sorted(DOCS.glob("*.md")):
        text, own = doc.read_text(), sections(doc)
        spans = [span for *_, span in parse_citations(text)]
        for m in SECTION.finditer(text):
            if any(a <= m.start() < b for a, b in spans):
                continue  # part of a docs/<file>.md citation, checked above
            if m.group(1) not in own:
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{_rel(doc)}:{line}: §{m.group(1)}: no heading numbered {m.group(1)}")
    assert not missing, "cross-references that do not resolve:\n" + "\n".join(missing)


def test_docs_headings_are_numbered_once_at_the_level_their_number_implies() -> None:
    problems = []
    for doc in sorted(DOCS.glob("*.md")):
        seen: set[str] = set()
        for line, level, number in numbered_headings(doc.read_text()):
            where = f"{_rel(doc)}:{line}: §{number}"
            if number in seen:
                problems.append(f"{where}: numbered twice")
            if level != number.count(".") + 2:
                problems.append(f"{where}: a level-{level} heading; expected {'#' * (number.count('.') + 2)}")
            parent = number.rpartition(".")[0]
            if parent and parent not in seen:
                problems.append(f"{where}: comes before (or without) its parent §{parent}")
            seen.add(number)
    assert not problems, "\n".join(problems)


def test_nothing_cites_notes_outside_the_repository() -> None:
    hits = []
    for path in repo_files():
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{_rel(path)}:{i}: {line.strip()}")
    assert not hits, "cite docs/<file>.md §N instead:\n" + "\n".join(hits)


# ------------------------------------------------------------------------------- development-process words

# How the project was built (its work sessions, its tracker's numbers) means nothing to a user who clones
# it: docs and comments say what the code does, dated by calendar date where history matters
# (docs/changes.md). Each pattern below is a process reference; the test cases show what stays allowed.
PROCESS_WORDS = re.compile(
    "|".join(
        [
            r"\b[Ss]essions?\s+\d+\b",  # "session 6", "sessions 3 to 5" (agent sessions are ids, not numbers)
            r"\b[Rr]ounds?\s+\d+\s+of\s+(?:development|work)\b",  # "round 3 of development"
            r"\b(?:[Ii]ssues?|PRs?|[Pp]ull\s+requests?|[Tt]ickets?)[\s-]#?\d+\b",  # "issue #17", "issue-18"
            r"(?:^|[\s(\[,;])#\d{1,5}\b(?![\w-])",  # a bare tracker number: "(#17)", "see #4" (prose: "No. 1")
        ]
    )
)
_COLOUR = re.compile(r"colou?r|fill|stroke|background", re.IGNORECASE)  # "#333" there is a colour


def process_words(text: str) -> list[tuple[int, str]]:
    """``(line, match)`` of every development-process reference in ``text``."""
    hits = []
    for i, line in enumerate(text.splitlines(), 1):
        for m in PROCESS_WORDS.finditer(line):
            if m.group().lstrip(" \t([,;").startswith("#") and _COLOUR.search(line):
                continue
            hits.append((i, m.group().strip()))
    return hits


def test_process_word_patterns_flag_references_and_nothing_else() -> None:
    flagged = [
        "measured in session 6",
        "Sessions 3 to 5 found it",
        "the policy before issue #17",
        "Merge branch 'issue-18-elastic'",
        "fixed in this round 2 of development",
        "see (#12) for the design",
        "as PR #40 did",
    ]
    allowed = [
        "## 1. Processes",
        "# 1) a comment numbering its steps",
        "x = 1  # 2 threads",
        "a black-box agent's session: X-Session-Id",
        "scope='session'",
        "medians of 3 interleaved rounds, rounds 0.96-1.01",
        'print(f"round {r}: buffer")',
        "color: #333",
        "`#[0-9]` in a regex",
        "children run in their own sessions",
    ]
    assert [bool(process_words(t)) for t in flagged] == [True] * len(flagged)
    assert [t for t in allowed if process_words(t)] == []


def test_no_development_process_words_in_the_repository() -> None:
    hits = [f"{_rel(p)}:{line}: {word}" for p in repo_files() for line, word in process_words(p.read_text())]
    assert not hits, (
        "development-process references (say what the code does; date history in docs/changes.md):\n"
        + "\n".join(hits)
    )


def design_section(number: str) -> str:
    """The text of ``docs/design.md`` §``number`` (a ``###`` heading), up to the next heading."""
    text = (DOCS / "design.md").read_text()
    match = re.search(rf"^### {re.escape(number)} .*?$(.*?)(?=^#{{2,3}} )", text, re.M | re.S)
    assert match, f"docs/design.md has no §{number}"
    return match.group(1)


def test_every_shipped_config_is_named_in_design_7_4() -> None:
    listed = design_section("7.4")
    missing = [
        p.name for p in sorted((ROOT / "configs").glob("*.yaml")) if f"`configs/{p.name}`" not in listed
    ]
    assert missing == [], "add these to docs/design.md §7.4: " + ", ".join(missing)


def test_every_config_section_is_in_design_7_2() -> None:
    from tandem.config import Config

    rows = set(re.findall(r"^\| `(\w+)` \|", design_section("7.2"), re.M))
    assert sorted(set(Config.model_fields) - rows) == [], "sections missing from docs/design.md §7.2"
    assert sorted(rows - set(Config.model_fields)) == [], "docs/design.md §7.2 names sections Config lacks"


CORE_PACKAGES = (
    "tandem",
    "buffer",
    "weightsync",
    "placement",
    "rollout",
    "learner",
    "launcher",
    "stages",
    "toy",
)
MEMBER_REF = re.compile(r"`([A-Z][A-Za-z0-9]*)\.([a-z_][A-Za-z0-9_]*)")


def class_members() -> dict[str, set[str]]:
    """Every class of the code (by name, over all modules) and its members, inherited ones included: methods,
    class-level names, dataclass and pydantic fields, and ``self.x`` set in its methods (read with ast)."""
    import ast

    own: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    files = [ROOT / "launch.py", *(p for pkg in CORE_PACKAGES for p in (ROOT / pkg).rglob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = own.setdefault(node.name, set())
            bases.setdefault(node.name, set()).update(b.id for b in node.bases if isinstance(b, ast.Name))
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            names.add(t.id)
                        elif (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        ):
                            names.add(t.attr)

    def members(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out = set(own.get(name, ()))
        for base in bases.get(name, set()) - seen:
            out |= members(base, seen | {name})
        return out

    return {name: members(name) for name in own}


def test_every_class_member_the_docs_name_exists() -> None:
    """``Class.member`` in a doc names a member the code's class of that name has (methods, fields,
    attributes), so a renamed method leaves no stale name behind."""
    classes = class_members()
    stale = []
    for doc in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for cls, member in MEMBER_REF.findall(line):
                if cls in classes and member not in classes[cls]:
                    stale.append(f"{_rel(doc)}:{n}: {cls}.{member}")
    assert stale == []
