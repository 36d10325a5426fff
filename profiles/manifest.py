"""Which committed results something reads, and the one list of them (profiles/MANIFEST.md).

A result file (a measurement, trace, table or log under profiles/ or tests/data/, by suffix; not the scripts, not
the READMEs; kernel configs a loader reads would be code, and live under gdtool/) stays in the tree only while a doc,
notebook, test, script or module names it: README.md, docs/*.md, the markdown under profiles/ and tests/data/,
notebooks/*.py, tests/*.py, profiles/*.py, the shell scripts under profiles/, gdtool/**/*.py. Not the manifest:
nothing reads results through it. A file is named

- in prose (markdown, and the comments and docstrings of code) by a path relative to the repository, to profiles/,
  or to the citing file's folder or one above it (`h200/README.md` writes `tests/pytest-cuda-run1.log` for
  profiles/h200/tests/...), by a glob (`*`, `**`, `{a,b}`), by a folder that holds it, or by a name relative to a
  folder the same table row or paragraph names (`bench/gemma-3-1b/` ... `bench.log`; `.../x.log`);
- in code by the paths the code builds: string constants, `/` and `os.path.join` chains, `.glob()` patterns,
  f-strings, names bound to string constants (a notebook's `results = "h200/decode-kernels"`), loop variables over
  lists of strings (`for preset in moe_presets`), pytest's parametrize, `Path(__file__)` followed through. A name
  the code cannot know stands for any name inside a path; a path that ends in one names no file.

What a mention does not name. A log (`log`, `*.log`, `probe.err`) is named by its own name or a glob, not by its
folder: naming `h200/nsys-graph/` shows the session, not the run's output (unless logs are all the folder holds, as
in `h200/determinism/`). A `<placeholder>` (`h200/tests/pytest-cuda-kernels-<commit>.log`) is a naming scheme: it
names the results it covers, no log and no sidecar. A folder in COLLECTIONS (profiles/h200/tests/, ...) holds the
runs of many commits: naming it names none of them. An environment sidecar (`env.json`, `env-<tag>.json|txt`) stays
while a result it describes stays: one in its folder, or for `env-<commit>` one of that commit on that device.

    python profiles/manifest.py               # per result file, what names it; the uncited ones at the end
    python profiles/manifest.py --uncited     # the uncited result files, one a line (what `git rm` takes)
    python profiles/manifest.py --check       # exit 1 unless every result file is cited and listed, under budget
    python profiles/manifest.py --draft       # a row to start from for each unlisted folder of cited results
"""
from __future__ import annotations

import argparse
import ast
import bisect
import functools
import itertools
import json
import posixpath
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "profiles/MANIFEST.md"

# Where results live, and what counts as one: by suffix (a `log` or `log-64` without one is a log too).
RESULT_FOLDERS = ("profiles/", "tests/data/")
RESULT_SUFFIXES = {".csv", ".json", ".jsonl", ".log", ".txt", ".md", ".gz", ".png", ".sqlite", ".nsys-rep",
                   ".ncu-rep", ".err", ".xml", ".svg", ".html", ".npz", ".pt"}
NOT_RESULTS = {"README.md", "MANIFEST.md"}        # the docs of the folders, not results

# The files that cite. Markdown results under profiles/ cite too, once something cites them (a breakdown.md names
# its export). Not the manifest, this script and its test: they name files to list or check them, not to read them.
CITING = ("README.md", "docs/*.md", "profiles/**/*.md", "tests/data/*.md", "notebooks/*.py", "tests/*.py",
          "profiles/*.py", "profiles/**/*.sh", "gdtool/**/*.py")
NOT_CITING = {MANIFEST, "profiles/manifest.py", "tests/test_manifest.py"}

# Folders that hold the runs of many parts or commits: naming one cites none of its files (see the docstring).
COLLECTIONS = {"tests", "profiles", "profiles/h200", "profiles/h100", "profiles/cpu", "tests/data",
               "profiles/h200/tests", "profiles/h100/tests", "profiles/h200/bench", "profiles/h200/bench/batches",
               "profiles/h200/bench/batches/llama-1b", "profiles/h200/bench/batches/llama-8b",
               "profiles/h200/bench/batches/qwen3-8b", "profiles/h200/nsys-fast"}

# The most bytes the tracked result files may hold (`git cat-file -s` of each blob). 48.5 MB are kept at the line's
# setting: 43.3 MB of them the gzipped Nsight Systems exports notebooks 01 and 03 read (every `nsys-*` session; every
# commit's MoE and Gemma 3 node trace, one row each in notebook 03's committed outputs) and tests/test_nsys.py.
BUDGET_BYTES = 49_000_000

UNKNOWN = "\0"          # the start of a path whose base the code cannot know (a root computed at run time)
PLACEHOLDER = "\1"      # a `<name>` in prose: any name, as `*`, but it names no log or sidecar (see `Index.named`)


def tracked(*folders: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *folders], cwd=ROOT, capture_output=True, check=True)
    return sorted(p for p in out.stdout.decode().split("\0") if p)


def is_result(path: str) -> bool:
    name = posixpath.basename(path)
    if not path.startswith(RESULT_FOLDERS) or name in NOT_RESULTS:
        return False
    return Path(name).suffix in RESULT_SUFFIXES or name == "log" or name.startswith("log-")


def is_log(path: str) -> bool:
    """A run's printed output (`log`, `log-64`, `*.log`, `probe.err`): a folder's mention does not cite it."""
    name = posixpath.basename(path)
    return name == "log" or name.startswith("log-") or name.endswith((".log", ".err"))


def sidecar_tag(path: str) -> str | None:
    """An environment sidecar's tag: '' for a folder's `env.json` or `<name>-env.json` (the whole folder's), the
    `<tag>` of `env-<tag>.json|txt` (the files whose names hold it); None for any other file."""
    name = posixpath.basename(path)
    if name == "env.json" or name.endswith("-env.json"):
        return ""
    m = re.fullmatch(r"env-(.+)\.(?:json|txt)", name)
    return m.group(1) if m else None


def result_files() -> list[str]:
    return [p for p in tracked(*RESULT_FOLDERS) if is_result(p)]


def tracked_bytes(paths) -> int:
    """The size of each file's blob at HEAD's index (`git ls-files -s`, `git cat-file`), summed."""
    paths = list(paths)
    if not paths:
        return 0
    staged = subprocess.run(["git", "ls-files", "-s", "-z", "--", *paths], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    blobs = [line.split()[1] for line in staged if line]
    sizes = subprocess.run(["git", "cat-file", "--batch-check=%(objectsize)"], cwd=ROOT, capture_output=True,
                           check=True, input="\n".join(blobs).encode()).stdout.split()
    return sum(map(int, sizes))


# --- patterns -------------------------------------------------------------------------------------------------

def _expand(pattern: str) -> list[str]:
    """`a/{b,c}.csv` as `a/b.csv`, `a/c.csv`."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)][:256]


@functools.lru_cache(maxsize=None)
def _regex(pattern: str) -> re.Pattern:
    """A glob as a regex: `*` and `?` stay inside one folder, `**/` spans any number of them."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] in ("*", PLACEHOLDER):
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


class Index:
    """The tracked result files, their folders, and what a (resolved) pattern names among them."""

    def __init__(self, files: list[str]):
        self.files = sorted(files)
        self._file_set = set(files)
        self._named: dict[str, list[str]] = {}
        self.folders: dict[str, list[str]] = {}
        for f in self.files:
            parts = f.split("/")
            for n in range(1, len(parts)):
                self.folders.setdefault("/".join(parts[:n]), []).append(f)
        self._folder_names = sorted(self.folders)

    @staticmethod
    def _starting(names: list[str], pattern: str) -> list[str]:
        """The names that start with the pattern's literal head (what a glob can match at all)."""
        head = re.split(r"[*?\[\1]", pattern, maxsplit=1)[0]
        return names[bisect.bisect_left(names, head):bisect.bisect_left(names, head + "\uffff")]

    def named(self, pattern: str) -> list[str]:
        if pattern not in self._named:
            self._named[pattern] = self._name(pattern)
        return self._named[pattern]

    def _name(self, pattern: str) -> list[str]:
        """The result files a repository-relative path or glob names: the file, or every file of a folder it
        names (a collection folder names none)."""
        pattern = pattern.rstrip("/")
        if not re.search(r"[A-Za-z0-9]", pattern) or pattern.startswith("../"):
            return []
        if PLACEHOLDER in pattern:   # a naming scheme: the results it covers, not the logs and sidecars of each run
            return [f for f in self._glob(pattern) if not is_log(f) and sidecar_tag(f) is None]
        return self._glob(pattern)

    def _glob(self, pattern: str) -> list[str]:
        if not any(c in pattern for c in "*?" + PLACEHOLDER):
            if pattern in self.folders:
                return [] if pattern in COLLECTIONS else self._inside(pattern)
            return [pattern] if pattern in self._file_set else []
        regex = _regex(pattern)
        out = [f for f in self._starting(self.files, pattern) if regex.fullmatch(f)]
        if set(pattern.rsplit("/", 1)[-1]) <= {"*", PLACEHOLDER}:
            return out   # `folder/*`: its files; an unknown last name (`root / name`) names no folder
        for folder in self._starting(self._folder_names, pattern):
            if folder not in COLLECTIONS and regex.fullmatch(folder):
                out += self._inside(folder)
        return out

    def _inside(self, folder: str) -> list[str]:
        """What naming a folder cites: its results, not the logs of the runs that made them (a log is cited by its
        own name), unless logs are all the folder holds (`h200/determinism/`: the logs are the results)."""
        inside = self.folders[folder]
        kept = [f for f in inside if not is_log(f)]
        return kept if any(sidecar_tag(f) is None for f in kept) else inside

    def tail(self, mention: str) -> list[str]:
        """A path relative to a folder the text around it names (`run1/probe.err` beside `decode-kernels/`, a bare
        `parity.log` in a paragraph on `h200/parity/`): the files whose path ends with it, where it has a folder
        part or all its matches lie in one folder (a bare `env.json` or `bench.log` names no file)."""
        if not re.search(r"[\w-]{3}", mention.replace("*", " ").replace(PLACEHOLDER, " ")):
            return []
        regex = _regex("**/" + mention.lstrip("/"))
        last = re.split(r"[*?\1]", mention.rsplit("/", 1)[-1])[-1]   # a literal end every match has
        found = [f for f in self.files if f.endswith(last) and regex.fullmatch(f)
                 and not (PLACEHOLDER in mention and (is_log(f) or sidecar_tag(f) is not None))]
        if "/" not in mention.strip("/") and len({posixpath.dirname(f) for f in found}) > 1:
            return []
        return found


def bases(citing: str) -> list[str]:
    """Where a relative path in `citing` may start: its folder and each folder above it, and profiles/."""
    folder, out = posixpath.dirname(citing), []
    while folder:
        out.append(folder)
        folder = posixpath.dirname(folder)
    return out + ["", "profiles"]


def resolve(token: str, citing: str, index: Index) -> set[str]:
    """The result files one mention in `citing` names, from each base (a code path whose root the code computes
    starts at any of them); failing that, in a doc, the files whose path ends with it (`Index.tail`)."""
    found: set[str] = set()
    if not re.search(r"[\w.-]{3}", token.replace("*", " ").replace(PLACEHOLDER, " ")):
        return found   # `*/*`, `**`: a pattern of a name the code cannot know, no path
    for one in _expand(token):
        if one.startswith(UNKNOWN):
            one = one.lstrip(UNKNOWN).lstrip("/")
        elif one.startswith("/"):
            continue   # an absolute path names nothing in the repository
        here = set()
        for base in bases(citing):
            path = posixpath.normpath(posixpath.join(base, one)) if one not in ("", ".") else base
            here.update(index.named(path))
        bare = "/" not in one.strip("/")   # a bare name in code or a script (`f"{name}*"`, a comment) names no file
        if not here and not one.startswith("../") and not (bare and (PLACEHOLDER in one or not citing.endswith(".md"))):
            here = set(index.tail(one))
        found |= here
    return found


# --- prose ----------------------------------------------------------------------------------------------------

TOKEN = re.compile(r"[\w.\-*/{},<>@+:=?~]+")


@functools.lru_cache(maxsize=None)
def prose_mentions(text: str) -> set[str]:
    """The path-like words of a text: with a `/` or a file suffix; a `<placeholder>` names a scheme, not a file."""
    out = set()
    text = re.sub(r"<([^<>/\s]*,[^<>/\s]*)>", r"{\1}", text)   # `<llama-8b,qwen3-8b>/...`: alternatives
    for word in TOKEN.findall(text):
        if "/" not in word and "." not in word and "<" not in word:
            continue   # no path part, no suffix, no placeholder: a plain word
        for piece in re.split(r"[:=]", word):
            piece = re.sub(r"^(?:\.\.\.|…)/", "", piece)   # `.../x.log`: x.log beside what the row named before
            piece = re.sub(r"^\.\.\.(?=[\w-])", "*", piece).lstrip("@~").rstrip(".,;")
            if "{" not in piece:
                pieces = piece.split(",")
            else:
                pieces = [piece]
            for p in pieces:
                p = re.sub(r"<[\w.-]*>", PLACEHOLDER, p.rstrip(".,;").lstrip(",;"))
                if not p or "<" in p or ">" in p or p.startswith("-"):
                    continue
                if "/" in p or re.search(r"\.[A-Za-z][\w-]*\*?$|\.\*$", p):
                    out.add(p)
    out.update(re.findall(r"`(log(?:-[\w.-]+)?)`", text))   # a run's `log`, `log-64`, named beside its results
    return out


def units(text: str) -> list[str]:
    """A doc's table rows and paragraphs: the text around a mention that may name its folder."""
    out, paragraph = [], []
    for line in text.splitlines():
        if line.lstrip().startswith("|") or not line.strip():
            out.append("\n".join(paragraph))
            paragraph = []
            out.append(line)
        else:
            paragraph.append(line)
    return [u for u in out + ["\n".join(paragraph)] if u.strip()]


def unit_citations(unit: str, citing: str, index: Index) -> set[str]:
    """What one row or paragraph names. A mention that names nothing alone (`bench.log`, `.../bench-pdl-x.log`) is
    tried in the folders the same row names, nearest first (the row of `bench/gemma-3-1b/` says `bench.log`)."""
    found, loose = set(), []
    for mention in prose_mentions(unit):
        got = resolve(mention, citing, index)
        found |= got
        if not got:
            loose.append(mention)
    if loose and found:
        around = {posixpath.dirname(f) for f in found}
        for mention in loose:
            for folder in around:
                while folder.count("/") >= 1:   # not above profiles/<device>/
                    hit = index.named(posixpath.join(folder, mention))
                    if hit:
                        found.update(hit)
                        break
                    folder = posixpath.dirname(folder)
    return found


# --- code -----------------------------------------------------------------------------------------------------

class _Paths:
    """The path strings a module builds (flow-insensitive: every value any name is bound to)."""

    LIMIT = 64
    PATHS = (ast.Constant, ast.JoinedStr, ast.BinOp, ast.Call)   # what may build a path (a name alone is a part)

    def __init__(self, tree: ast.AST, citing: str):
        self.citing = citing
        self.bound: dict[str, list[ast.AST]] = {}
        self.parent: dict[int, ast.AST] = {}
        nodes, stack = [], [tree]
        while stack:   # one walk: every node, each child's parent
            node = stack.pop()
            nodes.append(node)
            for child in ast.iter_child_nodes(node):
                self.parent[id(child)] = node
                stack.append(child)
        inner = set()   # parts of a longer path expression: the whole names what is read, not its folder
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        self.bound.setdefault(target.id, []).append(node.value)
            elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                self.bound.setdefault(node.target.id, []).append(ast.Starred(value=node.iter))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._parametrized(node)
            elif isinstance(node, ast.arguments):
                positional = node.posonlyargs + node.args
                for arg, default in zip(positional[len(positional) - len(node.defaults):], node.defaults):
                    self.bound.setdefault(arg.arg, []).append(default)
                for arg, default in zip(node.kwonlyargs, node.kw_defaults):
                    if default is not None:
                        self.bound.setdefault(arg.arg, []).append(default)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                inner.add(id(node.left))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("glob", "rglob", "joinpath"):
                inner.add(id(node.func.value))
        self.values: set[str] = set()
        for node in nodes:
            if isinstance(node, self.PATHS) and id(node) not in inner and not (
                    isinstance(node, ast.Constant) and not isinstance(node.value, str)):
                got = self.value(node, 0)
                if got:
                    self.values.update(got)

    def _parametrized(self, function) -> None:
        """`@pytest.mark.parametrize("a, b", [(x, y), ...])`: a is bound to each x, b to each y."""
        for decorator in function.decorator_list:
            if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                    and decorator.func.attr == "parametrize" and len(decorator.args) >= 2
                    and isinstance(decorator.args[0], ast.Constant) and isinstance(decorator.args[1], ast.List)):
                continue
            names = [n.strip() for n in str(decorator.args[0].value).split(",") if n.strip()]
            for case in decorator.args[1].elts:
                values = case.elts if len(names) > 1 and isinstance(case, ast.Tuple) else [case]
                for name, value in zip(names, values):
                    self.bound.setdefault(name, []).append(value)

    def value(self, node: ast.AST, depth: int) -> set[str] | None:
        """The strings an expression may be (None: unknown)."""
        if depth > 12:
            return None
        d = depth + 1
        if isinstance(node, ast.Constant):
            return {node.value} if isinstance(node.value, str) else None
        if isinstance(node, ast.Starred):   # a loop variable: each item of what it runs over
            items = self.items(node.value, d)
            return items
        if isinstance(node, ast.JoinedStr):
            parts = []
            for piece in node.values:
                got = self.value(piece.value, d) if isinstance(piece, ast.FormattedValue) else self.value(piece, d)
                parts.append(sorted(got) if got else ["*"])
            return self._limit("".join(p) for p in itertools.product(*parts))
        if isinstance(node, ast.Name):
            if node.id == "__file__":
                return {self.citing}
            loop = self._loop(node)
            if loop is not None:   # inside `for name in X` (or `for a, name in X`): the items of that X only
                return self.items(loop[0], d, loop[1])
            choices = set()
            for bound in self.bound.get(node.id, []):
                got = self.value(bound, d)
                if got is None:
                    return None
                choices |= got
            return self._limit(choices) if choices else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return self._join([node.left, node.right], d)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.value(node.left, d), self.value(node.right, d)
            if left is None or right is None:
                return None
            return self._limit(a + b for a in left for b in right)
        if isinstance(node, ast.Attribute):
            if node.attr == "parent":
                got = self.value(node.value, d)
                return {posixpath.dirname(g) if not g.startswith(UNKNOWN) or "/" in g else UNKNOWN
                        for g in got} if got else None
            return None
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("glob", "rglob") and isinstance(func, ast.Attribute) and node.args:
                base = self.value(func.value, d) or {UNKNOWN}
                pattern = self.value(node.args[0], d)
                if pattern is None:
                    return None
                if name == "rglob":
                    pattern = {"**/" + p for p in pattern}
                return self._limit(self._glue(b, p) for b in base for p in pattern)
            if name in ("resolve", "absolute", "expanduser") and isinstance(func, ast.Attribute):
                return self.value(func.value, d)
            if name == "joinpath" and isinstance(func, ast.Attribute):
                return self._join([func.value, *node.args], d)
            if name == "join" and isinstance(func, ast.Attribute) and self._is_os_path(func.value):
                return self._join(node.args, d)
            if name in ("Path", "PurePath", "PosixPath", "str", "fspath") and len(node.args) >= 1:
                return self._join(node.args, d) if len(node.args) > 1 else self.value(node.args[0], d)
            if name == "dirname" and node.args:
                got = self.value(node.args[0], d)
                return {posixpath.dirname(g) for g in got} if got else None
        return None

    def _loop(self, name: ast.Name) -> tuple[ast.AST, int | None] | None:
        """What the innermost loop (statement or comprehension) that binds `name` around it runs over, and where
        in each item the name sits (None: the item itself; i: `for a, name in ...`'s element i)."""
        def binds(target):
            if isinstance(target, ast.Name) and target.id == name.id:
                return True, None
            if isinstance(target, ast.Tuple):
                for i, element in enumerate(target.elts):
                    if isinstance(element, ast.Name) and element.id == name.id:
                        return True, i
            return False, None

        node = name
        while id(node) in self.parent:
            node = self.parent[id(node)]
            loops = [node] if isinstance(node, ast.For) else node.generators if isinstance(
                node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)) else []
            for loop in loops:
                found, position = binds(loop.target)
                if found:
                    return loop.iter, position
        return None

    @staticmethod
    def _is_os_path(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "path" or isinstance(node, ast.Name) and \
            node.id in ("path", "osp")

    def items(self, node: ast.AST, depth: int, position: int | None = None) -> set[str] | None:
        """The strings a loop over `node` binds (element `position` of each item where the loop unpacks)."""
        if depth > 12:
            return None
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            out = set()
            for element in node.elts:
                if position is not None:
                    if not isinstance(element, (ast.Tuple, ast.List)) or position >= len(element.elts):
                        return None
                    element = element.elts[position]
                got = self.value(element, depth)
                if got is None:
                    return None
                out |= got
            return out
        if isinstance(node, ast.Name):
            out = set()
            for bound in self.bound.get(node.id, []):
                got = self.items(bound, depth + 1, position)
                if got is None:
                    return None
                out |= got
            return out or None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("sorted", "list") \
                and node.args:
            return self.items(node.args[0], depth + 1, position)
        return self.value(node, depth) if position is None else None   # a glob's matches: the pattern itself

    def _join(self, parts, depth: int) -> set[str] | None:
        values = []
        for i, part in enumerate(parts):
            got = self.value(part, depth)
            if got is None:
                if 0 < i == len(parts) - 1:
                    return None   # `folder / name`, name unknown: no file in particular
                got = {UNKNOWN} if i == 0 else {"*"}
            values.append(sorted(got))
        if all(v == [UNKNOWN] or v == ["*"] for v in values):
            return None
        out = set()
        for combo in itertools.product(*values):
            path = combo[0]
            for piece in combo[1:]:
                path = self._glue(path, piece)
            out.add(path)
        return self._limit(out)

    @staticmethod
    def _glue(base: str, piece: str) -> str:
        if piece.startswith("/"):
            return piece
        if base == UNKNOWN:
            return UNKNOWN + "/" + piece
        return base.rstrip("/") + "/" + piece if base else piece

    def _limit(self, values) -> set[str] | None:
        out = set(itertools.islice(values, self.LIMIT + 1))
        return out if out and len(out) <= self.LIMIT else None


@functools.lru_cache(maxsize=None)
def code_mentions(source: str, citing: str) -> set[str]:
    """The paths a Python module builds, and the path-like words of its comments and docstrings."""
    try:
        built = _Paths(ast.parse(source), citing).values
    except SyntaxError:
        built = set()
    return {p for p in built if p and not p.startswith("-") and "\n" not in p and len(p) < 300} | \
        prose_mentions(source)


# --- citations ------------------------------------------------------------------------------------------------

def citing_files() -> list[str]:
    return [p for p in tracked() if p not in NOT_CITING and any(_regex(glob).fullmatch(p) for glob in CITING)]


def _is_code(path: str) -> bool:
    return path.endswith(".py")


def citations(index: Index | None = None, texts: dict[str, str] | None = None) -> dict[str, set[str]]:
    """result file -> the files that name it. A markdown result cites only once something cites it (a
    breakdown.md nothing reads keeps nothing alive)."""
    index = index or Index(result_files())
    texts = texts if texts is not None else {p: (ROOT / p).read_text(errors="replace") for p in citing_files()}
    named: dict[str, set[str]] = {}
    for citing, text in texts.items():
        if _is_code(citing):
            found = set()
            for mention in code_mentions(text, citing):
                found |= resolve(mention, citing, index)
        else:
            found = set()
            for unit in units(text):
                found |= unit_citations(unit, citing, index)
        found.discard(citing)
        named[citing] = found
    cited: dict[str, set[str]] = {}
    live = {c for c in named if not is_result(c)}
    while True:
        cited = {}
        for citing in live:
            for f in named[citing]:
                cited.setdefault(f, set()).add(citing)
        grown = live | {c for c in named if c in cited}
        if grown == live:
            break
        live = grown
    for f in index.files:   # a kept result's environment sidecar stays with it
        if f not in cited and (tag := sidecar_tag(f)) is not None:
            # env-<commit>: the machine of every run at that commit on that device; env.json: its folder's runs
            folder = "/".join(f.split("/")[:2]) if re.fullmatch(r"[0-9a-f]{7}", tag) else posixpath.dirname(f)
            kin = [g for g in index.files if g in cited and g.startswith(folder + "/") and sidecar_tag(g) is None
                   and tag in g[len(folder):]]
            if kin:
                cited[f] = {f"(sidecar of {posixpath.basename(kin[0])})"}
    return cited


# --- the manifest ---------------------------------------------------------------------------------------------

def manifest_rows(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, pattern, cells) of each row of the manifest's tables whose first cell is a path or glob in
    backticks (relative to profiles/ unless it starts with tests/; `{a,b}` alternatives allowed)."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))] \
            if line.lstrip().startswith("|") else []
        if cells and (m := re.fullmatch(r"`([^`]+)`", cells[0])):
            rows.append((number, m.group(1), cells))
    return rows


def manifest_pattern(pattern: str) -> str:
    return pattern if pattern.startswith("tests/") else "profiles/" + pattern


def listed_by(text: str, files: list[str]) -> tuple[dict[str, list[str]], list[tuple[int, str]]]:
    """file -> the manifest rows (their patterns) that list it, and the rows that list no file."""
    listed: dict[str, list[str]] = {}
    empty = []
    for number, pattern, _ in manifest_rows(text):
        regexes = [_regex(one) for one in _expand(manifest_pattern(pattern))]
        matches = [f for f in files if any(regex.fullmatch(f) for regex in regexes)]
        if not matches:
            empty.append((number, pattern))
        for f in matches:
            listed.setdefault(f, []).append(pattern)
    return listed, empty


def check(files: list[str] | None = None, texts: dict[str, str] | None = None, manifest: str | None = None,
          budget: int | None = BUDGET_BYTES) -> list[str]:
    """What is wrong between the tree, what cites it and the manifest ([] when nothing). The arguments stand in for
    the tracked result files, the citing files' texts and the manifest's text (tests/test_manifest.py)."""
    files = result_files() if files is None else sorted(files)
    cited = citations(Index(files), texts)
    problems = [f"{f}: no doc, notebook, test, script or module names it (git rm it: git history keeps it)"
                for f in files if f not in cited]
    text = manifest if manifest is not None else (ROOT / MANIFEST).read_text() if (ROOT / MANIFEST).exists() else ""
    listed, empty = listed_by(text, files)
    problems += [f"{MANIFEST}:{number}: `{pattern}` matches no tracked result file" for number, pattern in empty]
    problems += [f"{f}: not in {MANIFEST} (add a row; `python profiles/manifest.py --draft` starts one)"
                 for f in files if f not in listed]
    problems += [f"{f}: in more than one row of {MANIFEST} ({', '.join(rows)})" for f, rows in listed.items()
                 if len(rows) > 1]
    if budget is not None:
        size = tracked_bytes([f for f in files if (ROOT / f).exists()])
        if size > budget:
            problems.append(f"tracked result files hold {size:,} bytes, over the budget of {budget:,} "
                            f"(BUDGET_BYTES in profiles/manifest.py): keep what a reader needs, not every run")
    return problems


# --- drafting a row -------------------------------------------------------------------------------------------

def _environment(path: str) -> dict:
    """A JSON sidecar's environment (`environment` key of a bench sidecar, else the document), or {}."""
    try:
        doc = json.loads((ROOT / path).read_text())
    except (OSError, ValueError):
        return {}
    env = doc.get("environment", doc) if isinstance(doc, dict) else {}
    return env if isinstance(env, dict) else {}


def draft(files: list[str], cited: dict[str, set[str]]) -> list[str]:
    """A manifest row for each folder of the given files, filled from what the files say: the commit in their names
    (else their sidecars' `git_commit` when GDTOOL_COMMIT set it), the device and date in their sidecars, who reads
    them. What the files show and the command that made them are left for a person to write."""
    by_folder: dict[str, list[str]] = {}
    for f in files:
        by_folder.setdefault(posixpath.dirname(f), []).append(f)
    rows = []
    for folder, inside in sorted(by_folder.items()):
        envs = [_environment(f) for f in inside if f.endswith((".json", ".txt"))]
        named = {c for f in inside for c in re.findall(r"(?<![0-9a-f])[0-9a-f]{7}(?![0-9a-f])", f.split("/", 2)[-1])}
        commits = sorted(named or {str(e["git_commit"])[:7] for e in envs
                                   if e.get("git_commit_source") == "GDTOOL_COMMIT"})
        devices = sorted({str(e.get("device_name") or e.get("gpu")) for e in envs
                          if e.get("device_name") or e.get("gpu")})
        dates = sorted({str(e["date"])[:10] for e in envs if e.get("date")})
        readers = sorted({r for f in inside for r in cited.get(f, ()) if not r.startswith("(")})
        pattern = (folder[len("profiles/"):] if folder.startswith("profiles/") else folder) + "/*"
        if len(inside) == 1:
            pattern = inside[0][len("profiles/"):] if inside[0].startswith("profiles/") else inside[0]
        rows.append(f"| `{pattern}` | ? | ? | {', '.join(commits) or '?'} | {', '.join(devices) or '?'} | "
                    f"{' to '.join(dict.fromkeys([dates[0], dates[-1]])) if dates else '?'} | "
                    f"{', '.join(readers) or '?'} |")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--uncited", action="store_true", help="print only the uncited result files")
    p.add_argument("--check", action="store_true", help="exit 1 unless every result file is cited and listed")
    p.add_argument("--draft", action="store_true", help="print a manifest row to start from for each folder of "
                                                        "cited result files the manifest does not list")
    args = p.parse_args(argv)
    if args.check:
        problems = check()
        print("\n".join(problems) or f"ok: every result file is cited and in {MANIFEST}, "
                                      f"{tracked_bytes(result_files()):,} bytes (budget {BUDGET_BYTES:,})")
        return 1 if problems else 0
    files = result_files()
    cited = citations(Index(files))
    uncited = [f for f in files if f not in cited]
    if args.uncited:
        print("\n".join(uncited))
        return 0
    if args.draft:
        text = (ROOT / MANIFEST).read_text() if (ROOT / MANIFEST).exists() else ""
        listed, _ = listed_by(text, files)
        print("\n".join(draft([f for f in files if f in cited and f not in listed], cited)))
        return 0
    for f in files:
        if f in cited:
            print(f"{f}\t{', '.join(sorted(cited[f]))}")
    print(f"\n{len(files) - len(uncited)} cited, {len(uncited)} uncited ({tracked_bytes(uncited):,} bytes):")
    print("\n".join(uncited))
    return 0


if __name__ == "__main__":
    sys.exit(main())
