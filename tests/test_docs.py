"""What the docs say that the code can check: their links and the repository paths they name exist, the README's
mode table is `gdtool.MODES`, and the kernels options the docs and docstrings name are `gdtool.core.modes.KERNELS`.

No model is loaded: the checks read README.md, docs/*.md and the docstrings.
"""
import inspect
import itertools
import re
from pathlib import Path

import pytest

import gdtool
from gdtool.core import modes

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Top-level folders whose paths the docs write from the repository root. Others are left out: `tests/...` also
# names runs under profiles/h200/tests/, and a path like `bench/<preset>/...` is relative to the folder around it.
ROOTED = ("gdtool", "docs", "profiles", "scripts", "notebooks")


def _prose(text: str) -> str:
    """The text without fenced code blocks (their lines blanked, so line numbers stay)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return "\n".join(lines)


def _lines(doc: Path):
    """(line number, line) of a doc's prose, inline code removed: a link inside backticks is not a link."""
    for number, line in enumerate(_prose(doc.read_text()).splitlines(), 1):
        yield number, re.sub(r"`[^`]*`", "", line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (a link's text, not its target) lower-cased, characters other
    than letters, digits, spaces, hyphens and underscores dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every heading's anchor in a markdown file, a repeated heading's with GitHub's -1, -2 suffixes."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(doc.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")   # [text](target), ![alt](target)
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")                # [label]: target


def links(doc: Path):
    """(line number, target) of every markdown link in a doc that is not a URL (no scheme)."""
    for number, line in _lines(doc):
        targets = [m.group(1) for m in LINK.finditer(line)] + [m.group(1) for m in REFERENCE.finditer(line)]
        for target in targets:
            if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):
                yield number, target


def broken_link(doc: Path, target: str) -> str:
    """'' where a relative link from `doc` resolves (file, then heading anchor in a markdown file); else why not."""
    path, _, anchor = target.partition("#")
    file = doc if not path else (ROOT / path.lstrip("/") if path.startswith("/") else doc.parent / path)
    file = file.resolve()
    if ROOT not in (file, *file.parents):
        return f"{path} is outside the repository"
    if not file.exists():
        return f"{path} does not exist"
    if anchor and file.suffix == ".md" and anchor not in anchors(file):
        return f"{file.relative_to(ROOT)} has no heading with anchor #{anchor}"
    return ""


def _expand(path: str) -> list[str]:
    """A path with {a,b} alternatives as one path per alternative."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def missing_path(name: str) -> str:
    """'' where a repository path named in a doc exists; else why not. `*` and a `<placeholder>` stand for any
    name; a path without a suffix may name a file by its stem (a notebook pair: `notebooks/00_quickstart`)."""
    path = re.sub(r"#.*$|:\d+$", "", name)
    for one in _expand(path):
        pattern = re.sub(r"<[^<>/]*>", "*", one).rstrip("/")
        found = list(ROOT.glob(pattern)) if "*" in pattern else [ROOT / pattern] if (ROOT / pattern).exists() else []
        if not found and not Path(pattern).suffix and "*" not in pattern:
            found = list(ROOT.glob(pattern + ".*"))
        if not found:
            return f"{one} does not exist"
    return ""


def named_paths(doc: Path):
    """(line number, path) of every path in backticks in a doc's prose that starts at a folder of ROOTED."""
    for number, line in enumerate(_prose(doc.read_text()).splitlines(), 1):
        for match in re.finditer(r"`([^`\s]+)`", line):
            token = match.group(1)
            if re.match(rf"({'|'.join(ROOTED)})/[\w.\-/*<>{{}},]*(#[\w-]*|:\d+)?$", token):
                yield number, token


def _where(doc: Path, number: int) -> str:
    return f"{doc.relative_to(ROOT)}:{number}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = [f"{_where(doc, n)}: ({target}) {why}" for n, target in links(doc) if (why := broken_link(doc, target))]
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_repository_path_a_doc_names_exists(doc):
    missing = [f"{_where(doc, n)}: {why}" for n, name in named_paths(doc) if (why := missing_path(name))]
    assert not missing, "paths named in backticks that are not in the repository:\n" + "\n".join(missing)


def test_the_link_checks_catch_what_they_are_for(tmp_path):
    doc = ROOT / "docs" / "fast.md"
    assert broken_link(doc, "#hand-written-decode-kernels-kernelsfast") == ""
    assert broken_link(doc, "architecture.md") == "" and broken_link(doc, "../README.md#read-next") == ""
    assert "does not exist" in broken_link(doc, "no-such-file.md")
    assert "no heading" in broken_link(doc, "architecture.md#no-such-heading")
    assert "outside the repository" in broken_link(doc, "../../elsewhere.md")
    assert github_slug("Hand-written decode kernels: `kernels=\"fast\"`") == "hand-written-decode-kernels-kernelsfast"
    page = tmp_path / "page.md"
    page.write_text("# A\n## A\n[x](gone.md) `[y](in-code.md)` [z](https://example.com)\n```\n[w](fenced.md)\n```\n")
    assert anchors(page) == {"a", "a-1"}
    assert list(links(page)) == [(3, "gone.md")]
    assert missing_path("gdtool/core/modes.py") == "" and missing_path("notebooks/00_quickstart") == ""
    assert missing_path("profiles/h200/bench/<preset>/") == "" and missing_path("gdtool/kernels/{step,tail}.py") == ""
    assert missing_path("gdtool/kernels/{step,nothing}.py") == "gdtool/kernels/nothing.py does not exist"


def readme_mode_table() -> list[str]:
    """The first column of the README's table whose header starts with `| mode |`: the modes it documents."""
    rows, inside = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if not inside:
            inside = bool(cells) and cells[0] == "mode"
        elif not cells:
            break
        elif not set(cells[0]) <= set("-: "):
            rows.append(cells[0].strip("`"))
    return rows


def test_the_readme_mode_table_lists_every_mode_in_order():
    documented = readme_mode_table()
    assert documented, "README.md has no table with a `| mode |` header (the modes gdtool.MODES defines)"
    assert tuple(documented) == gdtool.MODES == modes.MODES, (
        f"README's mode table lists {documented}; gdtool.MODES is {list(gdtool.MODES)}: document each mode there")


KERNELS_VALUE = re.compile(r"""kernels\s*=\s*["']([\w-]+)["']((?:\s*/\s*["'][\w-]+["'])*)""")   # kernels="a"/"b"
KERNELS_FLAG = re.compile(r"--kernels[ =]([\w-]+(?:,[\w-]+)*)")                                   # --kernels a,b
RUNNER = re.compile(r"(?<![\w-])(%s)\+([\w-]+)" % "|".join(map(re.escape, modes.MODES)))         # step-graph+fast


def documented_kernels() -> dict[str, list[str]]:
    """Every kernels value README.md and docs/*.md name, with where: `kernels="x"` (and `"x"/"y"`), `--kernels
    x,y` and bench's `mode+kernels` runner names."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            names = []
            for match in KERNELS_VALUE.finditer(line):
                names += [match.group(1), *re.findall(r"[\w-]+", match.group(2))]
            names += [name for match in KERNELS_FLAG.finditer(line) for name in match.group(1).split(",")]
            names += [match.group(2) for match in RUNNER.finditer(line)]
            for name in names:
                found.setdefault(name, []).append(_where(doc, number))
    return found


def test_the_docs_name_the_kernels_options_of_the_code():
    found = documented_kernels()
    unknown = {name: where[:3] for name, where in found.items() if name not in modes.KERNELS}
    assert not unknown, f"kernels values in the docs that gdtool.core.modes.KERNELS {modes.KERNELS} lacks: {unknown}"
    undocumented = [name for name in modes.KERNELS if name not in found]
    assert not undocumented, f"kernels options no doc names (README.md, docs/*.md): {undocumented}"


def test_the_kernels_patterns_read_every_form_the_docs_use():
    line = 'kernels="compiled"/"fast", --kernels hf,compiled and device-loop+fast, not kernels=... or gpt-fast+x'
    names = [*KERNELS_VALUE.match(line).groups()]
    assert names[0] == "compiled" and re.findall(r"[\w-]+", names[1]) == ["fast"]
    assert KERNELS_FLAG.search(line).group(1) == "hf,compiled"
    assert [m.groups() for m in RUNNER.finditer(line)] == [("device-loop", "fast")]


def _names(doc: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", doc) is not None


@pytest.mark.parametrize("where", ["gdtool.core.modes", "gdtool.loops", "gdtool.loops.decode"])
def test_docstrings_that_list_the_modes_name_every_mode(where):
    import importlib
    doc = inspect.getdoc(importlib.import_module(where))
    assert [m for m in modes.MODES if not _names(doc, m)] == [], f"{where}'s docstring leaves out modes"


@pytest.mark.parametrize("where", ["gdtool.core.modes", "gdtool.decode", "gdtool.Decoder", "gdtool.profile"])
def test_docstrings_that_describe_kernels_name_every_option(where):
    import importlib
    module, _, attr = where.rpartition(".")
    obj = importlib.import_module(where) if where == "gdtool.core.modes" else getattr(importlib.import_module(module),
                                                                                       attr)
    doc = inspect.getdoc(obj)
    left_out = [k for k in modes.KERNELS if not re.search(rf"""["']{re.escape(k)}["']""", doc)]
    assert left_out == [], f"{where}'s docstring leaves out kernels options {left_out} (gdtool.core.modes.KERNELS)"
