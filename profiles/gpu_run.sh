#!/usr/bin/env bash
# Everything gdtool checks or measures on a CUDA GPU, in parts, into one results folder.
#
#   bash profiles/gpu_run.sh OUT_DIR PART [PART ...]
#
# PART: tests (every `pytest -m cuda` test), determinism (long greedy decodes, run to run and mode to
# mode), probe (device-loop smoke test), run (python -m gdtool run on
# llama-1b), nsys (profiles/nsys_session.sh graph node fixtures figures), nsys-graph (llama-1b, batch 1
# and 16, graph trace), nsys-node1 / nsys-node16 (batch 1 / 16, node trace, graph modes), nsys-fixtures,
# profile (in-process per-step table), bench-1b, bench-8b, sweep, notebooks, fast-tests (compiled step),
# devloop-host (device-loop host time per token, geometric lengths), nsys-compiled (graph trace,
# kernels=compiled), nsys-compiled-node (node trace of the compiled, fused step at batch 1, and its kernel
# breakdown), retest-devloop, fast, fast-decode, launch-probe (host cost of one graph launch),
# launch-timing (the same under gdtool.measure.timing's events and blocking-sync scheduling), launch-profiler (the
# same before and after a torch.profiler session in the process), fast-decode-64 (the
# fast-decode part at batch 64, compiled kernels only: the whole part outlasts its time limit), sample-64
# (batch 64, compiled sampling alone, Python stacks every 45 s: where it waits), sort-compile (inductor's
# compile time for the sampler's candidate order, by counting and with torch.sort, batch 1 and 64),
# select-64 (the samplers and the sort-free sampler's parts alone, compiled, batch 64), retest-fast
# (the cuda tests of the compiled step). select-64 reads SELECT_VARIANTS (default: all).
# Bench parts read BENCH_MODES (default below), BENCH_BATCHES (1,64), BENCH_FLAGS (e.g.
# --fuse-projections) and BENCH_SECONDS (the part's time limit).
# profile also writes profile/agreement.md (profiles/agreement.py against the committed nsys sessions);
# notebooks executes the three notebooks in place with their GPU parameters (profiles/regenerate.sh).
# Each part logs to OUT_DIR/log and appends its files to OUT_DIR/results.tar as soon as it ends,
# so a part cut short by a time limit leaves the others' results. The script exits 1 when any part
# failed or timed out (or was not a part), after running the others, and names them last.
# PYTHON picks the interpreter (default python3; e.g. PYTHON=.venv/bin/python). Where the checkout
# has no .git folder, set GDTOOL_COMMIT=<commit> so that every sidecar names the code that ran.
# Needs gdtool importable, plus the notebook / nvtx wheels and nsys where those parts run
# (see profiles/README.md).
set -uo pipefail
out=${1:?usage: bash profiles/gpu_run.sh OUT_DIR PART...}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
log="$out/log"
# bench: every mode with HF's kernels, and the graph modes with the compiled option too
bench_modes=${BENCH_MODES:-eager,forward-graph,step-graph,device-loop,step-graph+compiled,device-loop+compiled}

failed=()

keep() {  # keep PART: append $work/PART to the results tar
  if [ -e "$work/$1" ]; then tar -C "$work" -rf "$out/results.tar" "$1"; fi
}

part() {  # part NAME SECONDS COMMAND...
  local name=$1 seconds=$2 rc
  shift 2
  mkdir -p "$work/$name"
  echo "=== $name ($(date -u +%H:%M:%S))" | tee -a "$log"
  timeout "$seconds" "$@" 2>&1 | tee "$work/$name/log" | tail -n 40 >> "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "=== $name: stopped by its ${seconds} s time limit" | tee -a "$log"
  echo "=== $name exit $rc ($(date -u +%H:%M:%S))" | tee -a "$log"
  [ "$rc" = 0 ] || failed+=("$name")
  keep "$name"
}

if ! "$py" -c "import json, gdtool.measure.record as r; print(json.dumps(r.environment(), indent=2))" > "$work/env.json"; then
  echo "gdtool is not importable with $py: run from the checkout (or set PYTHON)" | tee -a "$log"
  exit 1
fi
tee -a "$log" < "$work/env.json"
keep env.json

for p in "$@"; do
  case $p in
    tests) part tests ${TESTS_SECONDS:-420} "$py" -m pytest -q -ra -m cuda -p no:cacheprovider tests ;;
    determinism-strict) part determinism-strict 90 "$py" profiles/determinism.py --model llama-1b --batch 1 \
           --max-new-tokens 192 --deterministic ;;
    retest) part retest 90 "$py" -m pytest -q -ra -m cuda -p no:cacheprovider tests/test_decoder_cuda.py \
           tests/test_fast_cuda.py tests/test_timing.py ;;
    retest-devloop) part retest-devloop 120 "$py" -m pytest -q -ra -m cuda -p no:cacheprovider tests/test_devloop.py \
           tests/test_device_loop_mode.py tests/test_timing.py ;;
    fast-tests) part fast-tests 150 bash -c "$py -m pytest -q -ra -p no:cacheprovider tests/test_fast_attention.py && \
           $py -m pytest -q -ra -m cuda -p no:cacheprovider tests/test_fast_cuda.py" ;;
    devloop-host) part devloop-host 240 "$py" -m gdtool sweep --models llama-1b --modes device-loop \
           --batches 1 4 16 64 --polls never --lengths geom:128:512 --profile --repeats 3 --no-progress \
           --out "$work/devloop-host/llama-1b_geom128_devloop_host.csv" ;;
    nsys-compiled) part nsys-compiled 300 "$py" -m gdtool profile --nsys --model llama-1b --batch 1,16 --trace graph \
           --modes forward-graph,step-graph --set kernels=compiled --max-new-tokens 48 --no-eos \
           --out "$work/nsys-compiled" ;;
    nsys-compiled-node) part nsys-compiled-node 200 bash -c "$py -m gdtool profile --nsys --model llama-1b --batch 1 \
           --trace node --modes step-graph --set kernels=compiled --set fuse_projections=true --max-new-tokens 48 \
           --no-eos --out $work/nsys-compiled-node && $py profiles/kernel_breakdown.py \
           $work/nsys-compiled-node/*.sqlite.gz --model llama-1b --out $work/nsys-compiled-node/breakdown.md" ;;
    launch-probe) part launch-probe 180 "$py" profiles/launch_probe.py --model llama-1b --batch 1 --flags \
           --out "$work/launch-probe/launch.json" ;;
    launch-timing) part launch-timing 150 "$py" profiles/launch_probe.py --model llama-1b --batch 1 --sizes "" \
           --kernels hf --variants plain,events,blocking,events+blocking --profile \
           --out "$work/launch-timing/launch.json" ;;
    launch-profiler) part launch-profiler 120 "$py" profiles/launch_probe.py --model llama-1b --batch 1 --sizes "" \
           --kernels hf --variants plain,after-profiler --profile --profile-after-profiler \
           --out "$work/launch-profiler/launch.json" ;;
    determinism) part determinism 60 "$py" profiles/determinism.py --model llama-1b --batch 1 --max-new-tokens 192 ;;
    probe) part probe 120 "$py" profiles/devloop_probe.py --out "$work/probe/probe.json" --iterations 10000 ;;
    run) part run 180 bash -c "for b in 1 16; do $py -m gdtool run --model llama-1b --batch \$b --prompt-len 128 \
           --max-new-tokens 256 --no-eos; done" ;;
    profile) part profile 150 bash -c "$py -m gdtool profile --model llama-1b --batch 1,16 --max-new-tokens 48 \
           --no-eos --modes eager,forward-graph,step-graph,device-loop --no-progress --out $work/profile && \
           $py profiles/agreement.py --profile $work/profile/summary.csv --nsys profiles/h200/nsys-graph/summary.csv \
           profiles/h200/nsys-node1/summary.csv profiles/h200/nsys-node16/summary.csv --out $work/profile/agreement.md" ;;
    nsys) part nsys 560 bash profiles/nsys_session.sh "$work/nsys" graph node fixtures figures ;;
    nsys-graph) part nsys-graph 230 "$py" -m gdtool profile --nsys --model llama-1b --batch 1,16 --trace graph \
           --modes eager,forward-graph,step-graph --max-new-tokens 48 --no-eos --out "$work/nsys-graph" ;;
    nsys-node1) part nsys-node1 90 "$py" -m gdtool profile --nsys --model llama-1b --batch 1 --trace node \
           --modes forward-graph,step-graph --max-new-tokens 48 --no-eos --out "$work/nsys-node1" ;;
    nsys-node16) part nsys-node16 120 "$py" -m gdtool profile --nsys --model llama-1b --batch 16 --trace node \
           --modes forward-graph,step-graph --max-new-tokens 48 --no-eos --out "$work/nsys-node16" ;;
    nsys-fixtures) part nsys-fixtures 120 bash profiles/nsys_session.sh "$work/nsys-fixtures" fixtures ;;
    bench-1b) part bench-1b ${BENCH_SECONDS:-480} "$py" -m gdtool bench --model llama-1b --batch ${BENCH_BATCHES:-1,64} --repeats 3 --modes "$bench_modes" ${BENCH_FLAGS:-} \
           --out "$work/bench-1b" ;;
    bench-8b) part bench-8b ${BENCH_SECONDS:-560} "$py" -m gdtool bench --model llama-8b --batch ${BENCH_BATCHES:-1,64} --repeats 2 --modes "$bench_modes" ${BENCH_FLAGS:-} \
           --out "$work/bench-8b" ;;
    fast) part fast 240 "$py" profiles/fast_probe.py --out "$work/fast/probe" --parts select,agreement \
           --models llama-1b,qwen2.5-0.5b,llama-8b --fused-models llama-1b ;;
    fast-decode) part fast-decode 300 "$py" profiles/fast_probe.py --out "$work/fast-decode/probe" --parts decode \
           --decode-batches 1,64 --decode-kernels hf,compiled,compiled-fused --cases greedy,sample ;;
    fast-decode-64) part fast-decode-64 200 "$py" profiles/fast_probe.py --out "$work/fast-decode-64/probe" --parts decode \
           --decode-batches 64 --decode-kernels compiled,compiled-fused --cases greedy,sample ;;
    sample-64) part sample-64 200 "$py" profiles/fast_probe.py --out "$work/sample-64/probe" --parts decode \
           --decode-batches 64 --decode-kernels compiled --cases sample --stack-every 45 ;;
    select-64) part select-64 150 "$py" profiles/fast_probe.py --out "$work/select-64/probe" --parts select \
           --batches 64 --select-kernels compiled ${SELECT_VARIANTS:+--select-variants "$SELECT_VARIANTS"} ;;
    retest-fast) part retest-fast 100 "$py" -m pytest -q -ra -m cuda -p no:cacheprovider tests/test_fast_cuda.py \
           tests/test_fast.py ;;
    sort-compile) part sort-compile 140 "$py" profiles/sort_compile_probe.py --batches 1,64 --limit 60 \
           --out "$work/sort-compile/sort_compile.json" ;;
    sweep) part sweep ${SWEEP_PART_SECONDS:-560} bash profiles/regenerate.sh "$work/sweep" sweep ;;
    notebooks) part notebooks ${NOTEBOOKS_PART_SECONDS:-400} bash profiles/regenerate.sh "$work/notebooks" notebooks ;;
    *) echo "unknown part $p (the parts are listed at the top of profiles/gpu_run.sh)" | tee -a "$log"
       failed+=("$p") ;;
  esac
done
rm -rf "$work"
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== failed: ${failed[*]}" | tee -a "$log"
  exit 1
fi
echo "=== every part passed" | tee -a "$log"
