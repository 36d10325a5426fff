"""profiles/MANIFEST.md holds the line on what results stay in the tree: every result file tracked under profiles/ and
tests/data/ is named by a doc, notebook, test, script or module, and listed in the manifest; every row of the manifest
lists a tracked file; the result files' bytes stay under profiles/manifest.py's BUDGET_BYTES.

No model is loaded: the checks read the git index and the citing files' text (`python profiles/manifest.py --check`
is the same check on the command line).
"""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "profiles"))
import manifest  # noqa: E402  (profiles/manifest.py)


@pytest.fixture(scope="module")
def tree():
    """The tracked result files and the citing files' text, read once."""
    return manifest.result_files(), {p: (ROOT / p).read_text(errors="replace") for p in manifest.citing_files()}


def test_every_result_file_is_cited_listed_and_under_budget(tree):
    files, texts = tree
    problems = manifest.check(files, texts)
    assert not problems, "\n".join(problems)


def test_result_bytes_stay_under_the_budget(tree):
    files, _ = tree
    size = manifest.tracked_bytes(files)
    assert 0 < size <= manifest.BUDGET_BYTES, f"{size:,} bytes of results against a budget of {manifest.BUDGET_BYTES:,}"


def test_the_check_catches_what_it_is_for(tree):
    files, texts = tree
    text = (ROOT / manifest.MANIFEST).read_text()
    # a result nothing names, and that no row lists
    stray = "profiles/h200/stray-probe.log"
    problems = manifest.check(files + [stray], texts, text, budget=None)
    assert any(p.startswith(f"{stray}: no doc") for p in problems), problems
    assert any(p.startswith(f"{stray}: not in") for p in problems), problems
    # a listed file gone from the tree: its row lists nothing
    gone = "profiles/h200/agreement.md"
    assert gone in files
    problems = manifest.check([f for f in files if f != gone], texts, text, budget=None)
    assert problems == [f"{manifest.MANIFEST}:{number}: `h200/agreement.md` matches no tracked result file"
                        for number, pattern, _ in manifest.manifest_rows(text) if pattern == "h200/agreement.md"]
    # the one reader of a file stops naming it (not an environment sidecar: it stays while its results are cited)
    cited = manifest.citations(manifest.Index(files), texts)
    alone, reader = next((f, next(iter(by))) for f, by in sorted(cited.items()) if len(by) == 1
                         and next(iter(by)) in texts and manifest.sidecar_tag(f) is None)
    problems = manifest.check(files, {p: t for p, t in texts.items() if p != reader}, text, budget=None)
    assert f"{alone}: no doc, notebook, test, script or module names it (git rm it: git history keeps it)" in problems
    # over the budget
    problems = manifest.check(files, texts, text, budget=1000)
    assert len(problems) == 1 and "over the budget" in problems[0], problems


@pytest.mark.parametrize("mention, citing, named", [
    # relative to the citing file's folder, to profiles/, to the repository
    ("tests/pytest-cuda-kernels-9e35b5d.log", "profiles/h200/README.md",
     {"profiles/h200/tests/pytest-cuda-kernels-9e35b5d.log"}),
    ("h200/agreement.md", "profiles/README.md", {"profiles/h200/agreement.md"}),
    ("profiles/h200/agreement.md", "docs/fast.md", {"profiles/h200/agreement.md"}),
    ("../sweeps/llama-1b_geom128.*", "profiles/h200/README.md",
     {"profiles/sweeps/llama-1b_geom128.csv", "profiles/sweeps/llama-1b_geom128.json"}),
    # a folder names its results, not its runs' logs; a collection folder names nothing
    ("h200/fast-decode/", "profiles/README.md",
     {f"profiles/h200/fast-decode/{name}" for name in ("decode.csv", "decode-64.csv", "decode-64-run2.csv",
                                                        "decode-64-run3.csv", "env.json", "env-64.json",
                                                        "env-64-run2.json", "env-64-run3.json")}),
    ("profiles/h200/tests/", "profiles/README.md", set()),
    # a <placeholder> names a scheme: the results it covers, no log
    ("h200/tests/pytest-cuda-kernels-<commit>.log", "profiles/README.md", set()),
])
def test_what_a_mention_names(tree, mention, citing, named):
    files, _ = tree
    index = manifest.Index(files)
    found = set()
    for token in manifest.prose_mentions(f"`{mention}`"):
        found |= manifest.resolve(token, citing, index)
    assert found == named


def test_paths_that_code_builds():
    source = '''
from pathlib import Path
root = Path(__file__).resolve().parent.parent
results = "h200/decode-kernels"
presets = ["qwen3-30b-a3b", "gpt-oss-20b"]
data = root / "profiles" / results
for preset in presets:
    for export in sorted((root / "profiles" / "h200" / "nsys-fast").glob(f"{preset}-b*-*/fast/*.sqlite.gz")):
        pass
for name in ("decode.csv", "decode-64.csv"):
    path = root / "profiles" / "h200" / "fast-decode" / name
unknown = root / "profiles" / some_name
'''
    built = manifest.code_mentions(source, "notebooks/99_example.py")
    # `Path(__file__).parent.parent` from notebooks/ is the repository's root
    assert "profiles/h200/decode-kernels" in built
    assert "profiles/h200/nsys-fast/gpt-oss-20b-b*-*/fast/*.sqlite.gz" in built   # the loop's items, not `*`
    assert "profiles/h200/fast-decode/decode-64.csv" in built
    assert not any(p.endswith("profiles/*") for p in built)   # a name the code cannot know names no file
