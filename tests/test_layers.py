"""gdtool's layers, bottom to top: core < kernels < loops < measure < frontends (docs/architecture.md).

A module may import modules of its own layer and of the layers below it, never one above, and no
import circle may form, at module level or inside a function. The package face (`gdtool/__init__.py`,
`__main__.py`) stands above every layer and no module under `gdtool/` imports it (`import gdtool`,
`from gdtool import x`, `from .. import x` reaching it, in a function too): a module imports a name from
the layer module that defines it, which the face only re-exports. The checker reads imports with `ast`,
relative ones included, and is itself tested on a copy of the package with an upward import, a face
import, a circle and a stray module planted.
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gdtool"

LAYERS = ("core", "kernels", "loops", "measure", "frontends")
FACE = "face"  # gdtool/__init__.py and gdtool/__main__.py

# Where a module left at the top of the package belongs: the flat names of the layout before the
# layers (a merge can bring one back), then prefixes. docs/architecture.md says what each layer holds.
HOME = {
    **dict.fromkeys(["compat", "settings", "feed", "sampling", "step", "signature", "graphs", "models", "ranges",
                     "syncs"], "core"),
    **dict.fromkeys(["fast", "fast_triton", "fast_gemv", "fast_splitkv", "fast_attention", "fast_ops",
                     "fast_sampling", "fast_decoder", "fast_fuse", "fast_check"], "kernels"),
    **dict.fromkeys(["decode", "decoder", "devloop"], "loops"),
    **dict.fromkeys(["timing", "costmodel", "workloads", "polls", "record", "nsys"], "measure"),
    **dict.fromkeys(["options", "cli", "bench", "sweep", "profile_cli", "plot", "widgets", "notebook"], "frontends"),
}
HOME_PREFIXES = {"fast_": "kernels", "kernel_": "kernels"}


def modules(package: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__.py)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = (package.name,) + path.relative_to(package).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (at `path`) imports, at module level or in a function."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if all(a.name.startswith("__") for a in node.names):
                continue  # `from .. import __version__`: the face's metadata, not its code
            # `from pkg import mod` imports pkg.mod where that is a module; else a name of pkg itself
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer(name: str) -> str | None:
    """The layer of a dotted module name; FACE for the package face; None for a module outside every layer."""
    parts = name.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return FACE
    return parts[1] if parts[1] in LAYERS else None


def rank(layer_name: str) -> int:
    return len(LAYERS) if layer_name == FACE else LAYERS.index(layer_name)


def graph_of(package: Path) -> dict[str, set[str]]:
    found = modules(package)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def strays(graph) -> list[str]:
    """One line per module outside the layers, naming where it belongs."""
    lines = []
    for name in graph:
        if layer(name) is not None:
            continue
        stem = name.split(".")[1]
        home = HOME.get(stem) or next((h for p, h in HOME_PREFIXES.items() if stem.startswith(p)), None)
        where = f"gdtool/{home}/" if home else f"the layer it serves ({', '.join(LAYERS)})"
        lines.append(f"gdtool/{stem}.py stands outside the layers: move it into {where} "
                     "(docs/architecture.md says what each layer holds)")
    return lines


def upward(graph) -> list[str]:
    """One line per import from a lower layer into a higher one."""
    lines = []
    for name, targets in sorted(graph.items()):
        mine = layer(name)
        for target in sorted(targets):
            theirs = layer(target)
            if None in (mine, theirs) or FACE in (mine, theirs):
                continue  # an import of the face is face_imports()'s to name
            if rank(theirs) > rank(mine):
                lines.append(f"{name} ({mine}) imports {target} ({theirs}): a lower layer imports a higher one; "
                             f"the order is {' < '.join(LAYERS)}")
    return lines


def face_imports(graph) -> list[str]:
    """One line per module under the package that imports the package face, from any layer, at module level or
    in a function; the face's own two modules are exempt. (`from .. import __version__`, the face's metadata,
    is no import of it: `imports` leaves such names out.)"""
    lines = []
    for name, targets in sorted(graph.items()):
        mine = layer(name)
        if mine == FACE:
            continue
        for target in sorted(t for t in targets if layer(t) == FACE):
            lines.append(f"{name} ({mine or 'outside the layers'}) imports {target}, the package face: no module "
                         "under the package imports the face; import the name from the layer module that "
                         "defines it (the face only re-exports it)")
    return lines


def circles(graph) -> list[set[str]]:
    """The import circles among modules (the face left out: it imports every layer by definition)."""
    inner = {n: {t for t in ts if layer(t) != FACE} for n, ts in graph.items() if layer(n) != FACE}

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in inner.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen
    reached = {n: reach(n) for n in inner}
    found = {frozenset({n} | {m for m in reached[n] if n in reached.get(m, ())}) for n in inner if n in reached[n]}
    return [set(c) for c in found]


def test_every_module_stands_in_a_layer():
    graph = graph_of(PACKAGE)
    assert not strays(graph), "\n".join(strays(graph))
    assert {layer(n) for n in graph} == set(LAYERS) | {FACE}


def test_no_layer_imports_a_higher_one():
    problems = upward(graph_of(PACKAGE))
    assert not problems, "\n".join(problems)


def test_no_module_imports_the_package_face():
    problems = face_imports(graph_of(PACKAGE))
    assert not problems, "\n".join(problems)


def test_no_import_circles():
    found = circles(graph_of(PACKAGE))
    assert not found, f"import circles among gdtool modules: {found}"


def test_the_measurement_layer_imports_no_command_line():
    graph = graph_of(PACKAGE)
    assert not {t for n, ts in graph.items() if layer(n) == "measure" for t in ts if layer(t) in ("frontends", FACE)}


def test_the_reader_sees_relative_absolute_and_function_level_imports(tmp_path):
    package = tmp_path / "gdtool"
    for folder in ("core", "loops", "frontends"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from .loops.decode import decode\n")
    (package / "core" / "step.py").write_text("")
    (package / "core" / "feed.py").write_text("")
    (package / "loops" / "decode.py").write_text(
        "from ..core import step\nimport gdtool.core.feed\n\ndef f():\n    from ..frontends.plot import draw\n"
        "    from gdtool.frontends import options\n    import gdtool\n")
    (package / "frontends" / "plot.py").write_text("")
    (package / "frontends" / "options.py").write_text("")
    graph = graph_of(package)
    assert graph["gdtool.loops.decode"] == {"gdtool.core.step", "gdtool.core.feed", "gdtool.frontends.plot",
                                            "gdtool.frontends.options", "gdtool"}
    assert graph["gdtool"] == {"gdtool.loops.decode"}


def _copy(tmp_path) -> Path:
    copy = tmp_path / "gdtool"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    assert not upward(graph_of(copy)) and not circles(graph_of(copy)) and not strays(graph_of(copy))
    return copy


def test_a_planted_upward_import_fails(tmp_path):
    copy = _copy(tmp_path)
    ranges = copy / "core" / "ranges.py"
    ranges.write_text(ranges.read_text() + "\n\ndef _planted():\n    from ..frontends import plot\n")
    assert upward(graph_of(copy)) == [
        "gdtool.core.ranges (core) imports gdtool.frontends.plot (frontends): a lower layer imports a higher one; "
        "the order is core < kernels < loops < measure < frontends"]


def test_a_planted_face_import_fails(tmp_path):
    copy = _copy(tmp_path)
    before = set(face_imports(graph_of(copy)))  # empty once the package imports no face; the planted lines are new
    plants = {
        "frontends/run.py": "\n\ndef _planted():\n    import gdtool\n    return gdtool.decode\n",  # a front end too
        "frontends/plot.py": "\n\ndef _planted():\n    from .. import decode\n",
        "measure/timing.py": "\nfrom gdtool import profile  # noqa\n",
        "core/ranges.py": "\n\ndef _planted():\n    import gdtool\n",
    }
    for where, text in plants.items():
        path = copy / where
        path.write_text(path.read_text() + text)
    (copy / "__main__.py").write_text((copy / "__main__.py").read_text() + "\nimport gdtool\n")  # the face: exempt
    added = sorted(set(face_imports(graph_of(copy))) - before)
    assert [line.split(" imports ")[0] for line in added] == [
        "gdtool.core.ranges (core)", "gdtool.frontends.plot (frontends)", "gdtool.frontends.run (frontends)",
        "gdtool.measure.timing (measure)"]
    assert added[0] == ("gdtool.core.ranges (core) imports gdtool, the package face: no module under the package "
                        "imports the face; import the name from the layer module that defines it (the face only "
                        "re-exports it)")
    assert not upward(graph_of(copy))  # each import is named once, by the face rule


def test_a_planted_circle_fails(tmp_path):
    copy = _copy(tmp_path)
    feed = copy / "core" / "feed.py"
    feed.write_text(feed.read_text() + "\nfrom . import step\n")  # step imports feed
    assert any({"gdtool.core.feed", "gdtool.core.step"} <= circle for circle in circles(graph_of(copy)))


def test_a_stray_module_names_its_layer(tmp_path):
    copy = _copy(tmp_path)
    (copy / "fast_moe.py").write_text("")
    (copy / "bench.py").write_text("")
    assert strays(graph_of(copy)) == [
        "gdtool/bench.py stands outside the layers: move it into gdtool/frontends/ "
        "(docs/architecture.md says what each layer holds)",
        "gdtool/fast_moe.py stands outside the layers: move it into gdtool/kernels/ "
        "(docs/architecture.md says what each layer holds)"]
