#!/usr/bin/env bash
# Set up a virtual environment for gdtool and run the main job or the tests.
#   bash scripts/dev.sh run [args...]    python -m gdtool run (default model, the four modes compared)
#   bash scripts/dev.sh test [args...]   the test suite (CPU; cuda tests skip without a GPU; Triton installed for
#                                        its interpreter, which runs the decode kernels on the CPU), then the
#                                        parity, error, window and zoo tests again against the oldest supported
#                                        transformers, in a second environment (VENV-oldest)
#   bash scripts/dev.sh plan run|test [--quick]
#                                        what `run` or `test` would install, and about how big it is; installs nothing
#   bash scripts/dev.sh test --quick [args...]
#                                        the quick tier (5-6 minutes on 2 cores): GDTOOL_QUICK=1 makes
#                                        tests/conftest.py leave out the tests marked slow (20 s or more) and
#                                        keep the first case of each parametrized test function (among those
#                                        -m/-k select), so every other test function runs once. No second
#                                        environment, and no setup where VENV already has gdtool, pytest-xdist,
#                                        torch and transformers (else it runs as for `test`). dev.sh takes
#                                        --quick (anywhere among the args) for itself; the rest go to pytest.
#                                        `test` without --quick is the full suite CI runs (GDTOOL_QUICK unset).
# Before installing anything, both commands say what they will install and about how big it is (SIZE_* below,
# measured; docs/install.md). They install only what is missing: an environment set up from this checkout's
# pyproject.toml and environment.yml (a stamp of them in VENV/.gdtool-setup) whose requirements are all there is
# left alone, so a second run installs nothing, and `run` does not reinstall an unchanged gdtool.
# VENV (default .venv) picks the environment. Torch is installed first: the CPU wheel where there is no
# NVIDIA driver, else the CUDA build pip picks.
# The tests run on every core (pytest-xdist, one worker per core; TEST_WORKERS=N sets how many,
# TEST_WORKERS=0 runs them in one process). Run as root where apt-get exists, `test` installs Debian's chromium
# (no recommended packages) for the notebook browser test; GDTOOL_NO_BROWSER=1 skips that install and that test.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-run}; shift || true
VENV=${VENV:-.venv}
OLDEST_TRANSFORMERS=5.17.0
PY=${PYTHON:-python3}

pip_block() {  # the pip entries of environment.yml, one per line
    "$1" - <<'PYEOF'
import re
lines, inside, indent = open("environment.yml").read().splitlines(), False, None
for line in lines:
    if re.match(r"\s*- pip:\s*$", line):
        inside, indent = True, len(line) - len(line.lstrip())
        continue
    if inside:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(line) - len(line.lstrip()) <= indent:
            break
        print(stripped[1:].strip())
PYEOF
}

# What each piece adds on disk, in MB (for the sums), measured on a 2-core CPU machine (Debian 12, Python 3.11,
# torch 2.13.0+cpu, transformers 5.25 and 5.17): du -sh for the environments, dpkg's Installed-Size for chromium.
# docs/install.md has the table.
SIZE_VENV=1900       # torch's CPU wheel (750 MB installed, a 190 MB download) and the pip block of environment.yml
SIZE_TRITON=1000     # Triton 3.9 (a wheel of 190-290 MB, by version)
SIZE_OLDEST=1900     # the same environment again, transformers 5.17
SIZE_CHROMIUM=400    # chromium and the 29 Debian packages it depends on, no recommended ones (a 125 MB download)

stamp() {  # stamp PIN: what an environment was set up from (a change in any of these sets it up again)
    { cat pyproject.toml environment.yml; echo "transformers pin: $1"; pwd -P; } | cksum | cut -d' ' -f1
}

missing() {  # missing VENV [PIN]: what VENV lacks, one word a line: venv, torch, triton, requirements
    local venv=$1 pin=${2:-}
    if [ ! -x "$venv/bin/python" ]; then
        echo venv
        return
    fi
    # -I: not this folder's gdtool.egg-info, the environment's own record of gdtool
    "$venv/bin/python" -I - "$(pwd -P)" "$pin" <<'PYEOF' || echo requirements
import importlib.metadata as md, json, os, sys
from urllib.parse import unquote, urlparse
root, pin = sys.argv[1], sys.argv[2]
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
if version("torch") is None:
    print("torch")
if version("triton") is None and version("torch") is not None and "+cpu" in version("torch"):
    print("triton")
try:
    from packaging.requirements import Requirement
    gdtool = md.distribution("gdtool")
    url = json.loads(gdtool.read_text("direct_url.json") or "{}")
    here = url.get("dir_info", {}).get("editable") and os.path.realpath(unquote(urlparse(url["url"]).path)) == root
    needed = [Requirement(text) for text in gdtool.requires or []]
    needed = [r for r in needed if r.name != "gdtool" and r.name != "torch" and
              (r.marker is None or any(r.marker.evaluate({"extra": extra}) for extra in ("", "notebooks", "dev")))]
    unmet = [r for r in needed if version(r.name) is None or not r.specifier.contains(version(r.name), True)]
    if not here or unmet or (pin and version("transformers") != pin):
        print("requirements")
except (ImportError, md.PackageNotFoundError):
    print("requirements")
PYEOF
    if [ "$(cat "$venv/.gdtool-setup" 2>/dev/null)" != "$(stamp "$pin")" ]; then
        echo requirements
    fi
}

has() {  # has WORD LIST: WORD is a line of LIST
    printf '%s\n' "$2" | grep -qx "$1"
}

wants_browser() {  # chromium is to be installed: asked for, missing, and installable (root, apt-get)
    [ -z "${GDTOOL_NO_BROWSER:-}" ] && ! command -v chromium >/dev/null 2>&1 && \
        command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]
}

gb() {  # gb MB: "400 MB", "1.9 GB"
    awk -v mb="$1" 'BEGIN { if (mb < 1000) printf "%d MB", mb; else printf "%.1f GB", mb / 1000 }'
}

plan() {  # plan WHAT [oldest]: say what WHAT (run or test) will install and about how much, before installing it
    local lines=() total=0 cuda='' main oldest='' hints=''
    if command -v nvidia-smi >/dev/null 2>&1; then cuda=1; fi
    main=$(missing "$VENV")
    if has venv "$main"; then
        if [ -n "$cuda" ]; then
            lines+=("$VENV: torch's CUDA build (several GB, not measured here) and environment.yml's pip block")
        else
            lines+=("$VENV: torch 2.13.0 (CPU) and environment.yml's pip block (gdtool, Jupyter...): $(gb $SIZE_VENV)")
            total=$((total + SIZE_VENV))
        fi
    else
        if has torch "$main"; then
            lines+=("$VENV: torch (the CPU wheel: 750 MB; with an NVIDIA driver, the CUDA build: several GB)")
        fi
        if has requirements "$main"; then
            lines+=("$VENV: gdtool again (editable), and what it lacks of pyproject.toml and environment.yml")
        fi
    fi
    if [ "$1" = test ] && [ -z "$cuda" ] && { has venv "$main" || has triton "$main"; }; then
        lines+=("$VENV: Triton, whose CPU interpreter runs the kernels' tests: $(gb $SIZE_TRITON)")
        total=$((total + SIZE_TRITON))
    fi
    if [ "$1" = test ] && wants_browser; then
        lines+=("chromium from apt, no recommended packages (the notebook's browser test): $(gb $SIZE_CHROMIUM)")
        total=$((total + SIZE_CHROMIUM))
        hints+="; GDTOOL_NO_BROWSER=1 leaves chromium out"
    fi
    if [ "${2:-}" = oldest ]; then
        oldest=$(missing "$VENV-oldest" "$OLDEST_TRANSFORMERS")
        if has venv "$oldest" && [ -n "$cuda" ]; then
            lines+=("$VENV-oldest: the same with transformers $OLDEST_TRANSFORMERS (the tests' second part)")
            hints+="; test --quick leaves the second environment out"
        elif has venv "$oldest"; then
            lines+=("$VENV-oldest: the same with transformers $OLDEST_TRANSFORMERS (the tests' second part): $(gb $SIZE_OLDEST)")
            total=$((total + SIZE_OLDEST))
            hints+="; test --quick leaves the second environment out"
        elif has torch "$oldest" || has requirements "$oldest"; then
            lines+=("$VENV-oldest: gdtool again (editable), and what it lacks (transformers $OLDEST_TRANSFORMERS)")
        fi
    fi
    if [ ${#lines[@]} = 0 ]; then
        echo "== dev.sh $1: nothing to install: $VENV${2:+ and $VENV-oldest} set up from this checkout already =="
        return
    fi
    echo "== dev.sh $1 will install (about, on disk; docs/install.md): =="
    printf '   %s\n' "${lines[@]}"
    if [ "$total" -gt 0 ]; then
        echo "   in all about $(gb $total)${cuda:+ besides the CUDA builds of torch}$hints"
    elif [ -n "$hints" ]; then
        echo "   ${hints#; }"
    fi
}

setup() {  # setup VENV [transformers pin]: install what `missing` finds missing (Triton aside), nothing else
    local venv=$1 pin=${2:-} lacking
    lacking=$(missing "$venv" "$pin")
    if ! has venv "$lacking" && ! has torch "$lacking" && ! has requirements "$lacking"; then
        return
    fi
    if has venv "$lacking"; then
        "$PY" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
    fi
    local py=$venv/bin/python
    if has venv "$lacking" || has torch "$lacking"; then
        if command -v nvidia-smi >/dev/null 2>&1; then
            "$py" -m pip install "torch>=2.11,<2.15"
        else
            "$py" -m pip install torch==2.13.0
        fi
    fi
    pip_block "$py" | while read -r req; do
        # shellcheck disable=SC2086
        "$py" -m pip install $req | sed '/^Requirement already satisfied/d'
    done
    if [ -n "$pin" ]; then
        "$py" -m pip install "transformers==$pin" | sed "/^Requirement already satisfied/d"
    fi
    stamp "$pin" > "$venv/.gdtool-setup"
}

interpreter_triton() {  # interpreter_triton VENV: Triton for its CPU interpreter, where torch came without it
    # A CPU build of torch has no Triton; with it, the tests run the decode kernels themselves on the CPU
    # against float64 (tests/test_fast_kernels.py). A CUDA build of torch brings its own Triton: left alone.
    # Measured on 2 cores: ~16 s to download and install (a 286 MB wheel), ~65 s of CPU for the tests it enables.
    if ! "$1/bin/python" -c "import triton" 2>/dev/null; then
        "$1/bin/python" -m pip install "triton>=3.6,<3.10"
    fi
}

ready() {  # ready VENV: the test environment exists (what `test --quick` needs to skip the setup)
    [ -x "$1/bin/python" ] && "$1/bin/python" -c \
        "import importlib.metadata as m; m.version('gdtool'); import pytest, xdist, torch, transformers" 2>/dev/null
}

browser() {  # Debian's chromium for the notebook browser test (as root, where apt exists), no recommended packages
    if wants_browser; then
        { apt-get update -q && apt-get install -y -q --no-install-recommends chromium; } || \
            echo "could not install chromium: the browser test will be skipped" >&2
    fi
}

case "$what" in
    run)
        plan run
        setup "$VENV"
        exec "$VENV/bin/python" -m gdtool run "$@"
        ;;
    test)
        quick='' args=()
        for arg in "$@"; do
            if [ "$arg" = --quick ]; then quick=1; else args+=("$arg"); fi
        done
        set -- ${args[@]+"${args[@]}"}
        if [ -n "$quick" ]; then export GDTOOL_QUICK=1; else unset GDTOOL_QUICK; fi
        if [ -n "$quick" ] && ready "$VENV"; then
            echo "== dev.sh test --quick: $VENV has gdtool, pytest-xdist, torch and transformers: nothing to install =="
        else
            if [ -n "$quick" ]; then plan test; else plan test oldest; fi
            setup "$VENV"
            interpreter_triton "$VENV"
            browser
        fi
        # one worker per core this process may use (nproc; xdist's "auto" counts physical cores, which on a
        # 2-vCPU machine can be 1); --dist loadgroup keeps each xdist_group's tests on one worker
        workers=${TEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}
        parallel=(-n "$workers" --dist loadgroup)
        if [ "$workers" = 0 ]; then parallel=(-p no:xdist); fi
        "$VENV/bin/python" -m pytest -q -ra "${parallel[@]}" "$@"
        if [ -n "$quick" ]; then
            echo "== quick tier: slow tests, further parametrized cases and the second environment left out =="
            exit 0
        fi
        echo "== parity, errors, windows and zoo against transformers $OLDEST_TRANSFORMERS (second environment: $VENV-oldest) =="
        setup "$VENV-oldest" "$OLDEST_TRANSFORMERS"
        "$VENV-oldest/bin/python" -m pytest -q -ra "${parallel[@]}" tests/test_parity.py tests/test_errors.py \
            tests/test_windows.py tests/test_zoo.py
        ;;
    plan)
        case "${1:-test}" in
            run) plan run ;;
            test) if [ "${2:-}" = --quick ]; then plan test; else plan test oldest; fi ;;
            *) echo "usage: bash scripts/dev.sh plan run|test [--quick]" >&2; exit 2 ;;
        esac
        ;;
    *)
        echo "usage: bash scripts/dev.sh run|test [args...], or plan run|test [--quick] to see what they would install" >&2
        exit 2
        ;;
esac
