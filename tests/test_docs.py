"""What the docs say that the code can check: their links and the repository paths they name exist, the README's
mode table is `gdtool.MODES`, the kernels options the docs and docstrings name are `gdtool.core.modes.KERNELS`, the
measured tables are what their result files give (`profiles/doc_tables.py`) and the README's figures at a glance
are in them, no commit hash stands in the prose of a
doc but the dated record's (`docs/history.md`), and docs/fast.md's environment switches are those the code reads.

No model is loaded: the checks read README.md, docs/*.md, the docstrings and the committed result files.
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


# -- measured tables, commit hashes, environment switches --------------------------------------------------------

def _doc_tables():
    import sys
    sys.path.insert(0, str(ROOT / "profiles"))
    import doc_tables  # profiles/doc_tables.py
    return doc_tables


def test_the_rendered_tables_are_what_their_files_give():
    """Every table between `<!-- rendered: NAME -->` and `<!-- end rendered -->` is what profiles/doc_tables.py makes
    from the result files it cites: rendering every doc again changes nothing."""
    doc_tables = _doc_tables()
    stale = doc_tables.stale()
    assert not stale, f"rendered tables that differ from their files in {stale}: python profiles/doc_tables.py --write"


def test_the_targets_table_says_which_runs_miss_their_target_and_by_how_much(tmp_path, monkeypatch):
    """fast-targets: a run at or past its share of the floor (80% at batch 1, 70% at 64) is met; one under it says by
    how many points; llama-1b at batch 1 on an H200 must also step in 0.75 ms, and says by how many µs it does not."""
    import json
    doc_tables = _doc_tables()
    name = doc_tables.PEERS_FAST[0]   # llama-1b, batch 1
    doc = json.loads((doc_tables.BENCH / name).read_text())
    doc["environment"].update(git_commit="abc1234", git_commit_source="GDTOOL_COMMIT")
    bench = tmp_path / "bench"
    (bench / name).parent.mkdir(parents=True)
    monkeypatch.setattr(doc_tables, "BENCHES", [bench])
    monkeypatch.setattr(doc_tables, "PEERS_FAST", [name])

    def row(pct, ms):
        for r in doc["summary"]:
            if r["label"] == "gdtool step-graph+fast":
                r.update(floor_pct=pct, ms_per_step=ms)
        (bench / name).write_text(json.dumps(doc))
        return [c.strip() for c in doc_tables.fast_targets().splitlines()[2].split("|")[1:-1]]

    assert row(81.0, 0.740)[3:7] == ["81.0", ">= 80, <= 0.75 ms", "yes", "-"]
    assert row(81.0, 0.790)[5:7] == ["no", "40 µs of the step"]
    assert row(77.0, 0.740)[5:7] == ["no", "3 points of the floor"]
    doc["environment"].update(device_name="NVIDIA H100 80GB HBM3")   # no step target on an H100
    assert row(81.0, 0.790)[4:7] == [">= 80", "yes", "-"]


def test_the_fast_peers_table_puts_an_h100_run_beside_the_h200_one(tmp_path, monkeypatch):
    """A bench file at the same place under the H100's bench folder gets its own row, right after the H200's, with
    its own device and commit; without it the table is the H200's alone."""
    import json
    doc_tables = _doc_tables()
    monkeypatch.setattr(doc_tables, "BENCHES", [doc_tables.BENCH])   # the H200's runs alone (the committed H100 ones aside)
    before = doc_tables.peers_fast().splitlines()
    name = doc_tables.PEERS_FAST[0]
    doc = json.loads((doc_tables.BENCH / name).read_text())
    doc["environment"].update(device_name="NVIDIA H100 80GB HBM3", git_commit="abc1234",
                              git_commit_source="GDTOOL_COMMIT")
    for row in doc["summary"]:
        if row.get("ms_per_step"):
            row["ms_per_step"] *= 1.25
            row["tok_s"] /= 1.25
    h100 = tmp_path / "h100" / "bench"
    (h100 / name).parent.mkdir(parents=True)
    (h100 / name).write_text(json.dumps(doc))
    monkeypatch.setattr(doc_tables, "BENCHES", [doc_tables.BENCH, h100])
    after = doc_tables.peers_fast().splitlines()
    assert len(after) == len(before) + 1 and after[:3] == before[:3] and after[4:] == before[3:]
    cells = [c.strip() for c in after[3].split("|")[1:-1]]
    h200 = [c.strip() for c in before[2].split("|")[1:-1]]
    assert cells[:3] == h200[:3] and cells[-2:] == ["H100 80GB HBM3", "abc1234"]
    assert float(cells[4]) == pytest.approx(1.25 * float(h200[4]), abs=1e-3)


def test_rerun_commands_measure_each_fast_peers_run_under_its_own_name(tmp_path):
    """`doc_tables.py --rerun GPU`: for each run of the fast peers table, a bench command whose arguments, read as the
    bench reads them, make the run's own config (the same file name: same runners, peers, kernels, sizes) in
    DIR/GPU/bench/<its folder>; a run the GPU's folder holds already gets none."""
    import json
    import shlex
    from gdtool.frontends import bench, options
    doc_tables = _doc_tables()
    lines = doc_tables.rerun("nogpu", str(tmp_path))
    assert len(lines) == len(doc_tables.PEERS_FAST)
    for line, name in zip(lines, doc_tables.PEERS_FAST):
        argv = shlex.split(line)
        assert argv[:4] == ["python", "-m", "gdtool", "bench"]
        args = bench.parser().parse_args(argv[4:])
        config = bench.BenchConfig(model=args.model[0], batch=args.batch[0], prompt_len=args.prompt_len,
                                   max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                                   modes=tuple(options.expand_modes(bench._none_or_list(args.mode))),
                                   peers=bench._none_or_list(args.peers), kernels=tuple(dict.fromkeys(args.kernels)),
                                   seed=args.seed, fused_projections=args.fuse_projections)
        assert f"{config.name}.json" == name.rsplit("/", 1)[-1], line
        committed = json.loads((doc_tables.BENCH / name).read_text())["config"]
        assert list(config.modes) == committed["modes"] and list(config.peers) == committed["peers"], line
        assert args.out == str(tmp_path / "nogpu" / "bench" / name.rsplit("/", 1)[0])
    assert doc_tables.rerun("h200") == []   # the H200's folder holds every one


def test_every_rendered_block_is_a_table_the_script_makes_in_a_doc_it_writes():
    doc_tables = _doc_tables()
    holding = {}
    for doc in DOCS:
        for name, _, _ in doc_tables.blocks(doc.read_text()):
            assert name in doc_tables.TABLES, f"{doc.relative_to(ROOT)}: <!-- rendered: {name} --> names no table"
            holding.setdefault(doc, []).append(name)
    assert set(holding) == set(doc_tables.DOCS), "doc_tables.DOCS must list every doc that holds a rendered table"
    names = [name for found in holding.values() for name in found]
    assert sorted(names) == sorted(set(names)) == sorted(doc_tables.TABLES), "each table stands in one place"


# A commit hash: 7 to 40 hex digits with a letter and a digit among them, not part of a word, a path or a file name.
HASH = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
# The docs whose prose may name commits: the dated record alone.
HASHES_ALLOWED = {"history.md"}


def prose_hashes(text: str) -> list[tuple[int, str]]:
    """(line, hash) of each commit hash in a doc's prose: not in a rendered table (its provenance column names
    commits), not in a code span that names a path (`profiles/h200/moe-sweep-c6bba88/`: a run's folder)."""
    out, rendered = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("<!-- rendered:"):
            rendered = True
        elif line.startswith("<!-- end rendered"):
            rendered = False
        if rendered:
            continue
        line = re.sub(r"`[^`]*/[^`]*`", "", line)
        out += [(number, match.group(0)) for match in HASH.finditer(line)]
    return out


@pytest.mark.parametrize("doc", [d for d in DOCS if d.parent.name == "docs" and d.name not in HASHES_ALLOWED],
                         ids=lambda d: str(d.relative_to(ROOT)))
def test_no_commit_hash_in_the_prose_of_a_doc(doc):
    found = [f"{_where(doc, n)}: {h}" for n, h in prose_hashes(doc.read_text())]
    assert not found, ("commit hashes in prose (the provenance of a figure goes in its rendered table's commit "
                       "column; a dated account in docs/history.md):\n" + "\n".join(found))


def test_the_hash_check_catches_what_it_is_for():
    text = ("measured at 57347d7 and 3e2aadc.\n`profiles/h200/moe-sweep-c6bba88/` and moe-sweep-a7748ba/ name runs\n"
            "<!-- rendered: x -->\n| a | 57347d7 |\n<!-- end rendered -->\n1024 tokens, 0.8752 ms, deadline\n")
    assert prose_hashes(text) == [(1, "57347d7"), (1, "3e2aadc")]


def _switches_in(paths) -> set[str]:
    return {name for path in paths for name in re.findall(r"\bGDTOOL_[A-Z][A-Z_]*[A-Z]\b", path.read_text())}


def documented_switches() -> list[str]:
    """The first column of docs/fast.md's table under "## Environment switches"."""
    text = (ROOT / "docs" / "fast.md").read_text()
    section = text[text.index("## Environment switches"):]
    section = section[:section.index("\n## ")]
    return [m.group(1) for m in re.finditer(r"^\| `([A-Z_]+)` \|", section, flags=re.M)]


def test_fast_md_lists_every_environment_switch_the_code_reads():
    """docs/fast.md's table of switches names every GDTOOL_ variable the package reads, and only variables that the
    package or the test session's hooks (tests/conftest.py) read."""
    documented = documented_switches()
    package = _switches_in((ROOT / "gdtool").rglob("*.py"))
    readers = package | _switches_in([ROOT / "tests" / "conftest.py"])
    assert len(documented) == len(set(documented)), documented
    assert package - set(documented) == set(), "switches the code reads that docs/fast.md's table leaves out"
    stale = {name for name in documented if name.startswith("GDTOOL_")} - readers
    assert stale == set(), f"switches docs/fast.md lists that nothing reads any more: {stale}"
    assert "TRITON_INTERPRET" in documented


_NUMBER = re.compile(r"(?<![\w.\-/])(\d[\d,]*(?:\.\d+)?)(x|%)?(?![\w\-])")


def _rendered(text: str) -> str:
    """The tables `profiles/doc_tables.py` renders into a doc (between its `rendered` markers)."""
    return "\n".join(re.findall(r"<!-- rendered: [\w-]+ -->\n(.*?)<!-- end rendered -->", text, re.S))


def test_the_readmes_figures_at_a_glance_are_in_the_tables_they_cite():
    """Each figure in the "measured" column of the README's at-a-glance table is a figure of the rendered tables in
    the doc its "where" column names, at the README's rounding (a share in % against the table's fraction): a
    figure left there when its run was replaced (llama-1b's rollout row gave 18,673 tok/s after that run's file
    was gone) fails."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("| at a glance |")
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), readme[start:].splitlines()[2:]))
    assert rows, "no rows under the README's at-a-glance table"
    checked = 0
    for row in rows:
        _, measured, where = (cell.strip() for cell in row.strip().strip("|").split("|"))
        doc = ROOT / re.search(r"`(docs/[\w.]+\.md)`", where).group(1)
        tables = _rendered(doc.read_text())
        known = {float(n.replace(",", "")) for n, _ in _NUMBER.findall(tables)}
        for text, unit in _NUMBER.findall(measured):
            decimals = len(text.split(".")[1]) if "." in text else 0
            value = float(text.replace(",", ""))
            if unit == "%":
                value, decimals = value / 100, decimals + 2
            assert any(round(k, decimals) == round(value, decimals) for k in known), \
                f"README at a glance: {text}{unit} ({row[:60]}...) is in none of {doc.name}'s rendered tables"
            checked += 1
    assert checked >= 10
