#!/usr/bin/env bash
# Regenerate the GPU results behind the notebooks, on any CUDA GPU, in this checkout:
#
#   bash profiles/regenerate.sh [COPY_TO] [sweep] [notebooks]      (parts: both by default)
#
# 1. sweep   llama-1b, geometric lengths (mean 128, cap 512, prompt 128):
#            step-graph at batch {1,4,16,64} x polling {1,4,16,64,never,async}, 3 repetitions;
#            device-loop (one launch per rollout, stops exactly) at the same batch sizes, 3 repetitions;
#            eager and forward-graph once per batch size (poll 1);
#            the three modes with EOS off (128 tokens per row, nothing to poll) for the mode comparison.
#            -> profiles/sweeps/llama-1b_geom128.csv (+ .json: GPU, driver, torch, transformers, commit, date)
# 2. notebooks executed in place with their GPU defaults (papermill): 00_quickstart (llama-1b, batch 1
#            and 16), 01_host_vs_device (llama-1b, batch 1, 16, 64, against the committed nsys sessions),
#            02_eos_polling_and_batch (reads the sweep). Each prints its environment first; on a machine
#            without a GPU they run tiny models instead and say so (not what to commit).
# With COPY_TO the results are also copied there (profiles/sweeps/, notebooks/*.ipynb). The logs never go into the
# tree: COPY_TO/regenerate.log and COPY_TO/notebooks/NN.log, or results/regenerate/ (git ignores it) without COPY_TO.
#
# The sweep is resumable: a rerun skips configs already in the CSV, so SWEEP_SECONDS (default 300)
# can cut it into chunks. Knobs: MODEL, BATCHES, POLLS, LENGTHS, REPEATS, SWEEP_SECONDS, NOTEBOOKS
# (which to execute, default "00 01 02"; "" for none), NOTEBOOK_TIMEOUT (s per notebook, default 240),
# CSV (default profiles/sweeps/<MODEL>_geom128.csv), NB01_YAML (parameters of notebook 01, e.g.
# "{models: [llama-1b], batches: [1, 16, 64]}"), EOS_OFF_REPEATS, PYTHON.
# Needs gdtool importable, and papermill + ipykernel (+ ipywidgets, nvtx) for the notebooks. Exits 1
# when a sweep command or a notebook failed (a failed notebook keeps its error cell; the others still run).
# Where the checkout has no .git folder, set GDTOOL_COMMIT=<commit> so the outputs name the code that ran.
set -euo pipefail
cd "$(dirname "$0")/.."
copy_to=${1:-}
shift || true
parts=" ${*:-sweep notebooks} "
python=${PYTHON:-python3}
model=${MODEL:-llama-1b}
batches=${BATCHES:-1 4 16 64}
polls=${POLLS:-1 4 16 64 never async}
lengths=${LENGTHS:-geom:128:512}
repeats=${REPEATS:-3}
sweep_seconds=${SWEEP_SECONDS:-300}
notebooks=${NOTEBOOKS:-00 01 02}
nb_timeout=${NOTEBOOK_TIMEOUT:-240}
csv=${CSV:-profiles/sweeps/${model}_geom128.csv}
logs=${copy_to:-results/regenerate}   # the run's logs: with its output, not in the tree
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)
log=$logs/regenerate.log
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the notebooks' kernels run in notebooks/
mkdir -p profiles/sweeps
exec > >(tee -a "$log") 2>&1
start=$SECONDS
stamp() { echo "## [$((SECONDS - start)) s] $*"; }
seconds() { local t0=$SECONDS line; while IFS= read -r line; do echo "[$((SECONDS - t0)) s] $line"; done; }

if [[ $parts == *" sweep "* ]]; then
# shellcheck disable=SC2086
stamp "sweep: step-graph x polling"
"$python" -m gdtool sweep --models "$model" --modes step-graph --batches $batches --polls $polls \
    --lengths "$lengths" --repeats "$repeats" --warmup 1 --out "$csv" --max-seconds "$sweep_seconds" --no-progress
stamp "sweep: device-loop (the 'poll never, stop exactly' end of the polling axis)"
# shellcheck disable=SC2086
"$python" -m gdtool sweep --models "$model" --modes device-loop --batches $batches --polls never \
    --lengths "$lengths" --repeats "$repeats" --warmup 1 --out "$csv" --no-progress
stamp "sweep: eager and forward-graph, poll 1"
# shellcheck disable=SC2086
"$python" -m gdtool sweep --models "$model" --modes eager forward-graph --batches $batches --polls 1 \
    --lengths "$lengths" --repeats 1 --warmup 1 --out "$csv" --no-progress
stamp "sweep: EOS off, three modes"
# shellcheck disable=SC2086
"$python" -m gdtool sweep --models "$model" --modes eager forward-graph step-graph device-loop --batches $batches \
    --polls never --lengths eos-off --max-new-tokens 128 --repeats "${EOS_OFF_REPEATS:-2}" --warmup 1 --out "$csv" --no-progress
fi

[[ $parts == *" notebooks "* ]] || notebooks=""
failed=""
for nb in $notebooks; do
  path=$(ls notebooks/${nb}_*.ipynb)
  params=()
  [[ $nb == 02 ]] && params=(-p results "sweeps/$(basename "$csv")" -p lengths "$lengths")
  [[ $nb == 01 && -n "${NB01_YAML:-}" ]] && params=(-y "$NB01_YAML")
  stamp "notebook $path"
  # 01 profiles three models, qwen3-30b-a3b among them: more than 240 s on an H200 (cut there at 907aa70)
  limit=$nb_timeout
  [[ $nb == 01 ]] && limit=${NOTEBOOK_01_TIMEOUT:-420}
  # its log: its cells' output as it came, progress bars included (where a run cut short spent its time)
  mkdir -p "$logs/notebooks"
  if ! timeout "$limit" "$python" -m papermill "$path" "$path" --kernel python3 --cwd notebooks \
      --execution-timeout "$limit" --no-progress-bar --log-output "${params[@]}" 2>&1 | seconds > "$logs/notebooks/${nb}.log"; then
    tail -n 5 "$logs/notebooks/${nb}.log"
    stamp "FAILED: $path (see its error cell and its log)"
    failed="$failed $path"
  fi
  # each notebook copied as soon as it ran: a run cut short keeps those that finished
  if [[ -n "$copy_to" ]]; then
    cp "$path" "$copy_to/notebooks/"
  fi
done
stamp "done${failed:+; failed:$failed}"

if [[ -n "$copy_to" ]]; then
  mkdir -p "$copy_to/profiles/sweeps"
  for made in "$csv" "${csv%.csv}.json"; do   # the sweep and its sidecar
    if [[ -e $made ]]; then cp "$made" "$copy_to/profiles/sweeps/"; fi
  done
fi
[[ -z "$failed" ]]
