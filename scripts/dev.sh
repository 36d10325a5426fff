#!/usr/bin/env bash
# Set up a virtual environment for gdtool and run the main job or the tests.
#   bash scripts/dev.sh run [args...]    python -m gdtool run (default model, the four modes compared)
#   bash scripts/dev.sh test [args...]   the test suite (CPU; cuda tests skip without a GPU; Triton installed for
#                                        its interpreter, which runs the decode kernels on the CPU), then the
#                                        parity, error, window and zoo tests again against the oldest supported
#                                        transformers, in a second environment (VENV-oldest, ~1.7 GB)
#   bash scripts/dev.sh test --quick [args...]
#                                        the quick tier (3-4 minutes on 2 cores): GDTOOL_QUICK=1 makes
#                                        tests/conftest.py leave out the tests marked slow (20 s or more) and
#                                        keep the first case of each parametrized test function (among those
#                                        -m/-k select), so every other test function runs once. No second
#                                        environment, and no setup where VENV already has gdtool, pytest-xdist,
#                                        torch and transformers (the setup reinstalls gdtool each call; else it
#                                        runs as for `test`). dev.sh takes --quick (anywhere among the args) for
#                                        itself; the rest go to pytest. `test` without --quick is the full suite
#                                        CI runs (GDTOOL_QUICK unset).
# VENV (default .venv) picks the environment. Torch is installed first: the CPU wheel where there is no
# NVIDIA driver, else the CUDA build pip picks.
# The tests run on every core (pytest-xdist, one worker per core; TEST_WORKERS=N sets how many,
# TEST_WORKERS=0 runs them in one process). Run as root where apt-get exists, `test` installs Debian's chromium for the notebook browser
# test; GDTOOL_NO_BROWSER=1 skips that install and that test.
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

setup() {  # setup VENV [transformers pin]
    local venv=$1 pin=${2:-}
    if [ ! -x "$venv/bin/python" ]; then
        "$PY" -m venv "$venv"
    fi
    local py=$venv/bin/python
    "$py" -m pip install -q --upgrade pip >/dev/null
    if ! "$py" -c "import torch" 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1; then
            "$py" -m pip install -q "torch>=2.11,<2.15"
        else
            "$py" -m pip install -q torch==2.13.0
        fi
    fi
    pip_block "$py" | while read -r req; do
        # shellcheck disable=SC2086
        "$py" -m pip install -q $req
    done
    if [ -n "$pin" ]; then
        "$py" -m pip install -q "transformers==$pin"
    fi
}

interpreter_triton() {  # interpreter_triton VENV: Triton for its CPU interpreter, where torch came without it
    # A CPU build of torch has no Triton; with it, the tests run the decode kernels themselves on the CPU
    # against float64 (tests/test_fast_kernels.py). A CUDA build of torch brings its own Triton: left alone.
    # Measured on 2 cores: ~16 s to download and install (a 286 MB wheel), ~65 s of CPU for the tests it enables.
    if ! "$1/bin/python" -c "import triton" 2>/dev/null; then
        "$1/bin/python" -m pip install -q "triton>=3.6,<3.10"
    fi
}

ready() {  # ready VENV: the test environment exists (what `test --quick` needs to skip the setup)
    [ -x "$1/bin/python" ] && "$1/bin/python" -c \
        "import importlib.metadata as m; m.version('gdtool'); import pytest, xdist, torch, transformers" 2>/dev/null
}

browser() {  # Debian's chromium for the notebook browser test (as root, where apt exists)
    if [ -n "${GDTOOL_NO_BROWSER:-}" ]; then
        return
    fi
    if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null || \
            echo "could not install chromium: the browser test will be skipped" >&2
    fi
}

case "$what" in
    run)
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
        if [ -z "$quick" ] || ! ready "$VENV"; then
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
    *)
        echo "usage: bash scripts/dev.sh run|test [args...]" >&2
        exit 2
        ;;
esac
