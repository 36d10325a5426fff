#!/usr/bin/env bash
# Record the Nsight Systems sessions described in docs/nsys.md on one CUDA GPU, and draw their pictures.
#
#   profiles/nsys_session.sh OUT_DIR [PART ...]     PART: graph node fixtures figures (default: all four)
#
# graph     llama-1b, batch 1 and 16, eager / forward-graph / step-graph, 48 new tokens with EOS off (47 steps;
#           the host still polls on schedule), two decodes per process (the summary reads the second),
#           --cuda-graph-trace=graph: host time.      -> OUT_DIR/llama-1b-graph-b{1,16}.tar
# node      the same with --cuda-graph-trace=node: kernel-level busy time and gaps.
#                                                     -> OUT_DIR/llama-1b-node-b{1,16}.tar
# fixtures  tiny-llama, batch 4, 32 steps, node trace, slimmed exports for tests/data/.  -> OUT_DIR/fixtures.tar
# figures   the docs' pictures, from the tars above (needs no GPU).                     -> OUT_DIR/figures.tar
#
# Each llama-1b tar holds the <config>.sqlite.gz exports, steps.csv, summary.csv and env.json; every
# table printed goes to OUT_DIR/summary.txt. Extra session arguments can come through $NSYS_SESSION_ARGS
# (e.g. NSYS_SESSION_ARGS="--set eos_poll_interval=8").
# Recording needs gdtool importable, the nvtx package, and nsys on PATH, in $GDTOOL_NSYS or under /opt/nvidia.
set -euo pipefail
out=${1:?usage: profiles/nsys_session.sh OUT_DIR [graph] [node] [fixtures] [figures]}
shift
parts=${*:-graph node fixtures figures}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
read -r -a extra <<< "${NSYS_SESSION_ARGS:-}"

session() {  # session NAME ARGS...: one `profile --nsys` run into $work/NAME; its table goes to summary.txt
  local name=$1
  shift
  echo "## $name" | tee -a "$out/summary.txt"
  "$python" -m gdtool profile --nsys --no-progress --out "$work/$name" "$@" | tee -a "$out/summary.txt"
  tar -C "$work" -cf "$out/$name.tar" "$name"
}

for trace in graph node; do
  [[ " $parts " == *" $trace "* ]] || continue
  for batch in 1 16; do
    session "llama-1b-$trace-b$batch" --model llama-1b --batch "$batch" --trace "$trace" --max-new-tokens 48 \
      --no-eos "${extra[@]}"
  done
done

if [[ " $parts " == *" fixtures "* ]]; then
  session fixtures --model tiny-llama --batch 4 --trace node --max-new-tokens 33 --prompt-length 16 --repeat 1 \
    --no-eos --fixture
  ls -l "$work/fixtures"
fi

if [[ " $parts " == *" figures "* ]]; then
  for batch in 1 16; do
    for trace in graph node; do
      tar -C "$work" -xf "$out/llama-1b-$trace-b$batch.tar"
    done
  done
  mkdir -p "$work/figures"
  "$python" - "$work" <<'EOF'
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import pandas as pd

from gdtool.measure import nsys

work = Path(sys.argv[1])
for batch in (1, 16):
    steps = pd.read_csv(work / f"llama-1b-graph-b{batch}" / "steps.csv")
    fig, _ = nsys.plot_steps(steps)
    fig.savefig(work / "figures" / f"steps_llama-1b_b{batch}_graph.png", dpi=120)
    exports = sorted((work / f"llama-1b-node-b{batch}").glob("*.sqlite.gz"),
                     key=lambda p: nsys.MODES.index(nsys.parse_name(p.name)["mode"]))
    fig, _ = nsys.plot_timelines(exports, first_step=20, steps=3)
    fig.savefig(work / "figures" / f"timeline_llama-1b_b{batch}_node.png", dpi=120)
print("figures:", sorted(p.name for p in (work / "figures").iterdir()))
EOF
  tar -C "$work" -cf "$out/figures.tar" figures
fi
ls -l "$out"
