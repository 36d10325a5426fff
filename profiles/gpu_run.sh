#!/usr/bin/env bash
# Everything gdtool checks or measures on a CUDA GPU, in parts, into one results folder.
#
#   bash profiles/gpu_run.sh OUT_DIR PART [PART ...]
#
# PART, each the maker of files that profiles/README.md names (its table says which):
#   tests          every `pytest -m cuda` test
#   determinism, determinism-strict   long greedy decodes, run to run and mode to mode (the second with
#                  torch.use_deterministic_algorithms)
#   profile        in-process per-step table, and profile/agreement.md (profiles/agreement.py against the
#                  committed nsys sessions)
#   nsys           profiles/nsys_session.sh graph node fixtures figures; nsys-fixtures: its fixtures alone
#   nsys-graph     llama-1b, batch 1 and 16, graph trace; nsys-node1 / nsys-node16: node trace, graph modes
#   nsys-compiled  graph trace, kernels=compiled; nsys-compiled-node: node trace of the compiled, fused
#                  step at batch 1, and its kernel breakdown (profiles/kernel_breakdown.py)
#   tests-kernels  the cuda tests of gdtool's own kernels (fast forward families, the greedy tail, Gemma 3, MoE experts, the linear layers of other models, attention
#                  (the fused combine), the window sweep with them), and which kernel paths passed them
#                  (profiles/kernel_paths.py)
#   tests-fast-sweep  the seeded kernels="fast" sweep in bf16, captured (tests/fastcases.py, seed 1: every family of the
#                  fast forward, 1-64 rows against the line, padding, sampling, EOS; every mode bit for bit its uncaptured twin's),
#                  and which kernel paths passed it; tests-kernels leaves it out (its call's time)
#   fresh-compiles profiles/fresh_compiles.py on FRESH_CASE (5193, the fast sweep's case whose modes rounded apart at
#                  48346b3), as it is and with EOS off: FRESH_PROCESSES (8) new processes per setting (inductor's default,
#                  and its deterministic option), FRESH_JOBS (8) at once, FRESH_MODES (eager step-graph device-loop):
#                  whether a fresh compile decodes the same, and whether `deterministic` makes it
#   tests-pick     the cuda tests TESTS_PICK names (pytest's arguments: files, node ids, -k "..."), -n none
#   recheck        what changed after 829123a (passed at cb883e2): the timing tests alone (Kineto records on torch
#                  2.11; their busy-vs-span checks are not for a shared GPU), capture through a device mask
#                  (`ids[image_mask] = 0`) in the capture tests and the zoo's image-text cases that 829123a refused
#   windows-gpt-oss  gpt-oss's captured window sweep with kernels=fast: its attention in the split-KV kernels with
#                  sinks (attention.sinks_attention), its experts in gdtool's kernels
#   nsys-fast      each of NSYS_MODEL (gemma-3-1b; space-separated) at NSYS_BATCH (1) and NSYS_PROMPT (128; set, the
#                  folder ends -p<it>), NSYS_FUSED=1 with fused projections (the folder ends -fused: the bench's runs
#                  at batch 64), step-graph, node trace with each of NSYS_KERNELS
#                  ("fast compiled"), and each one's kernel breakdown (profiles/kernel_breakdown.py): the per-kernel
#                  account an issue asks for where a target is missed, each kernel against its own floor at the copy
#                  bandwidth measured first in the same part (copy_gb_s.txt beside the export) (GDTOOL_UNTESTED_KERNELS=1, as the bench parts:
#                  the paths the bench runs, CUDA_TESTED or not; at c6bba88 without it qwen3-30b-a3b's batch-64 trace
#                  was HF's experts, its grouped path then untested)
#   tests-zoo-kernels  the zoo with the kernel options, captured: every sliding-window architecture with
#                  kernels="compiled", every MoE architecture with kernels="fast" (tests-kernels leaves them out)
#   tests-zoo      the captured zoo (`pytest -m cuda tests/test_zoo.py`, -n TEST_WORKERS, default 15), and each
#                  case's outcome (outcomes.jsonl: profiles/zoo_table.py --cuda-outcomes renders it)
#   nsys-sliding-moe  finishes profiles/h200/nsys-sliding-moe (qwen3-30b-a3b at batch 16, graph trace)
#   bench-qwen3-8b, bench-gemma, bench-moe, bench-gpt-oss   bench with kernels hf, compiled, fast (GDTOOL_UNTESTED_KERNELS=1:
#                  the fast paths whose cuda tests have not passed yet run too)
#   bench-peers    the fast peers table's benches (profiles/doc_tables.py --rerun GPU) for this GPU (h100 or h200, from
#                  its name; BENCH_GPU, where given, must match it; on a CPU it names the folder, h100 unless given),
#                  the runs of BENCH_MODELS (llama-1b; a regex over the preset names) its bench folder lacks
#                  (BENCH_AGAIN=1: all of them, this GPU's rows at the head), at
#                  BENCH_BATCH (both: 1 and 64) (GDTOOL_UNTESTED_KERNELS=1, as the H200 rows; BENCH_PEERS=generate-static
#                  times that peer where the H200 run had none, the MoE presets at batch 1); OUT/bench-peers/GPU/bench/
#                  holds them under the names the table reads: copy them into profiles/GPU/bench/, doc_tables.py --write
#   bench-fold     the embedding lookup apart (0) and folded into the first qkv_rope (1), alternating, twice each,
#                  for each of FOLD_MODELS (llama-1b gemma-3-1b) at BENCH_BATCHES (1): the lever's before and after
#   bench-attention the fast step of each of ATTN_MODELS (llama-1b gemma-3-1b) at BENCH_BATCHES (64), fused projections,
#                  at each of ATTN_PLANS (LOOP:[TARGET] pairs, default "1024: 4096: 8192: 1024:264"): the split loop's
#                  loop_elements and, where given, the split target programs (plan_bench.py --loop-elements, --target;
#                  none: the device's), one process each: whether a wider loop block or more chunks a (row, key/value
#                  head) shorten attention at 64 rows (Gemma 3's one key/value head: 64 programs at one chunk each)
#   bench-sliding  the fast step of each of SLIDING_MODELS (gemma-3-1b) at BENCH_BATCHES (64), fused projections, with
#                  a sliding layer's sdpa calls left to HF's sdpa (GDTOOL_SLIDING_SPLIT=0) and taken into the split-KV
#                  kernels (1), one process each (plan_bench.py --sliding): the sliding lever's before and after
#   bench-argmax   the fast step of each of ARGMAX_MODELS (llama-1b gemma-3-1b) at BENCH_BATCHES (64), fused projections,
#                  greedy, its argmax left to inductor (GDTOOL_COMPILED_ARGMAX=0) and in gdtool's two stages (1), one
#                  process each (plan_bench.py --argmax): the argmax lever's before and after
#   bench-dot      the fast step of each of DOT_BENCH_MODELS (llama-1b gemma-3-1b) at BENCH_BATCHES (64), fused
#                  projections, its linear layers in cuBLAS's products (GDTOOL_DOT_LINEAR=0) and in gdtool's split-K
#                  tensor-core kernel (1), one process each (plan_bench.py --dot): the dot lever's before and after
#   bench-autotune the fast step of each of AUTOTUNE_MODELS (llama-1b gemma-3-1b) at BENCH_BATCHES (64), fused projections,
#                  with gdtool's compiled programs under inductor's default (0) and max-autotune (1; plan_bench.py
#                  --max-autotune: Triton matmul templates, their epilogues fused), one process each: the lever's before
#                  and after at 64 rows, where the step is the compiled HF forward
#   moe-block      profiles/moe_block.py: one MoE block captured, gdtool's kernels against HF's
#   ncu-experts    Nsight Compute (`ncu --set full`) on gdtool's experts kernels in profiles/moe_block.py's captured
#                  Qwen3-30B-A3B block: the small kernels at 1 token, the grouped ones at NCU_GROUPED_BATCH (64);
#                  each report's details page as CSV (throughput, occupancy, stall reasons): why gate/up reads at
#                  2.2 TB/s at one token where the matrix-vector kernels reach 3-4
#   moe-sweep      profiles/moe_sweep.py for each of MOE_SWEEP_MODELS (qwen3-30b-a3b; one model a call) at
#                  MOE_SWEEP_BATCHES (default: the model's list, 1-64): the grouped
#                  kernels' tile configs at 1-64 tokens (gpt-oss-20b: its grouped and small kernels'), one block
#                  captured, beside HF's batched_mm: what the tuning file's experts sections should hold
#                  (WRITE_CONFIG=FILE: the picks written into OUT/tuning/FILE's name, a copy of
#                  gdtool/kernels/configs/FILE; kernels-sweep and attention-plan write theirs into the same copy;
#                  that copy names this machine's folders: commit the CSVs, then profiles/tuning_files.py --write)
#   tuning-check   the shipped tuning file of this GPU (profiles/tuning_files.py --config device) against the sweeps
#                  kernels-sweep and moe-sweep wrote earlier in the same run (give those parts first, without
#                  WRITE_CONFIG): each choice within 3% of the fresh sweep's fastest; fails when any is out or none ran
#   kernels-probe  profiles/decode_kernels_probe.py: float64 checks and GEMV rows against cuBLAS
#   attention-plan the same probe's attention part, llama-1b's attention at one row also at each split plan
#                  (ATTENTION_TARGETS: split_plan's TARGET_PROGRAMS), the combine fused and not
#   agree          the same probe's teacher-forced agreement of kernels="fast" with HF's kernels (top-1 share, largest
#                  logit difference; compare_kernels) for each of AGREE_MODELS (qwen3-30b-a3b,gpt-oss-20b) at
#                  AGREE_BATCHES (1,16,64): the per-preset agreement the MoE issue asks for
#   accuracy       the same probe's accuracy() for each of ACCURACY_MODELS (gpt-oss-20b) at ACCURACY_BATCHES (1,16):
#                  kernels="fast"'s and HF's bf16 logits, each against the model cast to float32 (largest and mean
#                  error, top-1 share): whether fast rounds more than HF's kernels where `agree` finds them apart
#   kernels-qk     the same, quick: the float64 checks, then Gemma-3-1B's and Qwen3-8B's projections at 1 and 4
#                  rows, qkv_rope's two q/k-norm kernels against the one whole-head kernel they replaced
#   kernels-sweep  every projection of SWEEP_MODELS (gemma-3-1b) at SWEEP_ROWS (1; e.g. 2,4: gemv_config is tuned at
#                  one row, and one pass of 2-4 rows costs 24-83% more on the H200) over the probe's full sweep of tile
#                  configs (BLOCK_N, warps, programs per SM), beside cuBLAS: which config the defaults should pick
#   kernels-dot    the same probe's gemv part with --dot: each projection of DOT_MODELS (llama-8b,qwen3-8b,llama-1b) at
#                  DOT_ROWS (2,3,4), cuBLAS, the matrix-vector kernel and gdtool's split-K dot kernel (dot.py) at its
#                  tuning's config and neighbours (profiles/dot_gemv.py): whether it reaches cuBLAS where the
#                  matrix-vector kernels lose (DOT_ROWS=64 DOT_MODELS=llama-1b,gemma-3-1b: cuBLAS and the dot kernel
#                  alone, the products of the 64-row step)
#   bench-cublas   the compiled step (kernels="compiled": cuBLAS's / inductor's matmuls, no linear swap) of each of
#                  CUBLAS_MODELS (space-separated; llama-8b) at COMPARE_BATCHES (1,2,3,4): the 1-4-row fast steps
#                  against the matmuls, where forward.MEASURED_LINES' line belongs per shape
#   bench-line     the fast step of each of LINE_MODELS (space-separated; llama-8b) at BENCH_BATCHES (2,3,4) with the line at
#                  LINE_ROWS (1; plan_bench.py --gemv-rows): past it the compiled HF forward with cuBLAS's products and
#                  gdtool's split-KV attention, what the fast step runs past the line, against the kernels below it
#   bench-pdl      the fast step of each of PDL_MODELS (space-separated; gemma-3-1b) at BENCH_BATCHES (1) with GDTOOL_PDL=0, auto, 1
#                  (no peers): which PDL setting each preset's step wants
#   bench-1b, bench-8b   python -m gdtool bench
#   rollout-bench  python -m gdtool bench --workload rollout: ROLLOUT_MODEL (llama-1b), ROLLOUT_SLOTS (64),
#                  ROLLOUT_PROMPTS (1024), ROLLOUT_PROMPT_LEN (128, or LO,HI: ragged), ROLLOUT_LENGTHS (geom:128:512),
#                  ROLLOUT_REPEATS (1), ROLLOUT_FLAGS (e.g.
#                  --runners static: qwen3-8b's static runner alone fills a lent machine's 600 s command)
#   tests-rollout  the rollout's cuda tests (tests/test_rollout_cuda.py: the twin rule captured, and real-size bf16)
#   sweep, notebooks     profiles/regenerate.sh (notebooks: executed in place with their GPU parameters)
#   devloop-host   device-loop host time per token, geometric lengths
#   fast, fast-decode, fast-decode-64, select-64   profiles/fast_probe.py: sampler cost and agreement,
#                  greedy vs sampling per step (fast-decode-64: batch 64, compiled kernels only), the
#                  samplers' parts alone at batch 64 (reads SELECT_VARIANTS, default: all)
# Parts of earlier sessions whose question is answered (retests, launch and sort-compile probes) are
# gone; docs/history.md names the command and commit of each of their committed files.
# Bench parts read BENCH_MODES (default below), BENCH_BATCHES (1,64), BENCH_FLAGS (e.g. --fuse-projections, or
# --prompt-len 1024: Gemma 3's every window full), BENCH_KERNELS (bench-qwen3-8b, bench-gemma, bench-moe; default
# hf,compiled,fast), BENCH_PEERS (bench-moe; default none: e.g. generate-static, the peer its issue asks for in the
# same run) and BENCH_SECONDS (the part's time limit).
# Each part logs to OUT_DIR/log and appends its files to OUT_DIR/results.tar as soon as it ends (over
# 15 MiB at the end: results.tar.gz.00, .01, ...),
# so a part cut short by a time limit leaves the others' results. The script exits 1 when any part
# failed or timed out (or was not a part), after running the others, and names them last.
# GPU_RUN_SECONDS: the whole run's limit, where a command around it has one (a lent machine's): each part is cut
# to the time left, less 20 s to keep its files, and a part with less than 10 s left is not begun. Set it below
# the outer limit: a part the outer limit cuts loses its files. GPU_RUN_DEADLINE: the same as a moment (Unix seconds),
# for a command that runs this script several times, each with its own settings: set it once, before the first
# (`export GPU_RUN_DEADLINE=$(( $(date +%s) + 540 ))`), and every part of every run ends 20 s before it. Those runs
# may share OUT_DIR: each appends to its log and results.tar (two files for the whole command).
# PYTHON picks the interpreter (default python3; e.g. PYTHON=.venv/bin/python). Where the checkout
# has no .git folder, set GDTOOL_COMMIT=<commit> so that every sidecar names the code that ran.
# Needs gdtool importable, plus the notebook / nvtx wheels and nsys where those parts run
# (see profiles/README.md).
set -uo pipefail
out=${1:?usage: bash profiles/gpu_run.sh OUT_DIR PART...}
if [ -n "${GPU_RUN_SECONDS:-}" ] && ! [[ $GPU_RUN_SECONDS =~ ^[0-9]+$ ]]; then
  echo "GPU_RUN_SECONDS=$GPU_RUN_SECONDS: give the whole run's limit in whole seconds (e.g. 570)" >&2
  exit 2
fi
if [ -n "${GPU_RUN_DEADLINE:-}" ] && ! [[ $GPU_RUN_DEADLINE =~ ^[0-9]+$ ]]; then
  echo "GPU_RUN_DEADLINE=$GPU_RUN_DEADLINE: give the end of the whole command as Unix seconds (e.g. \$(( \$(date +%s) + 560 )))" >&2
  exit 2
fi
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
write_config=""
if [ -n "${WRITE_CONFIG:-}" ]; then   # the sweeps write their picks into a copy of this tuning file (results: tuning/)
  mkdir -p "$work/tuning" && cp "gdtool/kernels/configs/$WRITE_CONFIG" "$work/tuning/" || exit 2
  write_config="$work/tuning/$WRITE_CONFIG"
fi
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
AGREE_BATCHES=${AGREE_BATCHES:-1,16,64}
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
  if [ -n "${GPU_RUN_SECONDS:-}${GPU_RUN_DEADLINE:-}" ]; then
    # the whole run's limit: a part gets what is left, less a margin to keep its files; one that cannot start
    # is named, not begun (a command around the run that cuts it first loses the part it cut, files and all)
    local left=999999 why=""
    [ -n "${GPU_RUN_SECONDS:-}" ] && left=$((GPU_RUN_SECONDS - SECONDS - 20)) why="${GPU_RUN_SECONDS} s run limit"
    if [ -n "${GPU_RUN_DEADLINE:-}" ] && [ $((GPU_RUN_DEADLINE - $(date +%s) - 20)) -lt "$left" ]; then
      left=$((GPU_RUN_DEADLINE - $(date +%s) - 20)) why="GPU_RUN_DEADLINE"
    fi
    if [ "$left" -lt 10 ]; then
      echo "=== $name: not run, $why reached" | tee -a "$log"
      failed+=("$name")
      return
    fi
    [ "$left" -lt "$seconds" ] && seconds=$left
  fi
  echo "=== $name ($(date -u +%H:%M:%S), at most $seconds s)" | tee -a "$log"
  timeout "$seconds" "$@" 2>&1 | tee "$work/$name/log" | tail -n 40 >> "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "=== $name: stopped by its ${seconds} s time limit" | tee -a "$log"
  echo "=== $name exit $rc ($(date -u +%H:%M:%S))" | tee -a "$log"
  [ "$rc" = 0 ] || failed+=("$name")
  # a log over 4 MiB (a test's captured debug output) travels gzipped: what comes back is capped
  [ "$(stat -c %s "$work/$name/log")" -gt 4194304 ] && gzip -9 "$work/$name/log"
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
    nsys-fast) part nsys-fast ${NSYS_FAST_SECONDS:-300} bash -c "b=${NSYS_BATCH:-1}; \
           p=${NSYS_PROMPT:-128}; gbs=\$($py -c 'import torch; from gdtool.measure.roofline import copy_bandwidth; \
           print(round(copy_bandwidth(torch.device(\"cuda\")) / 1e9, 1))') || exit 1; \
           for m in ${NSYS_MODEL:-gemma-3-1b}; do for k in ${NSYS_KERNELS:-fast compiled}; do \
           d=$work/nsys-fast/\$m-b\$b${NSYS_PROMPT:+-p\$p}${NSYS_FUSED:+-fused}/\$k; \
           GDTOOL_UNTESTED_KERNELS=1 $py -m gdtool profile --nsys --model \$m --batch \$b --prompt-len \$p --trace node \
           --modes step-graph --set kernels=\$k ${NSYS_FUSED:+--set fuse_projections=true} \
           --max-new-tokens 48 --no-eos --no-progress --out \$d && echo \$gbs > \$d/copy_gb_s.txt && \
           $py profiles/kernel_breakdown.py \$d/*.sqlite.gz --model \$m --copy-gb-s \$gbs --prompt-len \$p \
           --new-tokens 48 --out \$d/breakdown.md || exit 1; done; done" ;;
    determinism) part determinism 60 "$py" profiles/determinism.py --model llama-1b --batch 1 --max-new-tokens 192 ;;
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
    rollout-bench) part rollout-bench ${BENCH_SECONDS:-560} "$py" -m gdtool bench --workload rollout \
           --model ${ROLLOUT_MODEL:-llama-1b} --slots ${ROLLOUT_SLOTS:-64} --prompts ${ROLLOUT_PROMPTS:-1024} \
           --prompt-len ${ROLLOUT_PROMPT_LEN:-128} --lengths ${ROLLOUT_LENGTHS:-geom:128:512} --repeats ${ROLLOUT_REPEATS:-1} \
           ${ROLLOUT_FLAGS:-} --out "$work/rollout-bench" ;;
    tests-rollout) part tests-rollout ${TESTS_PICK_SECONDS:-300} "$py" -m pytest -q -rfE --tb=short -m cuda \
           -n ${TEST_WORKERS:-6} -p no:cacheprovider -p no:logging tests/test_rollout_cuda.py ;;
    fast) part fast 240 "$py" profiles/fast_probe.py --out "$work/fast/probe" --parts select,agreement \
           --models llama-1b,qwen2.5-0.5b,llama-8b --fused-models llama-1b ;;
    fast-decode) part fast-decode 300 "$py" profiles/fast_probe.py --out "$work/fast-decode/probe" --parts decode \
           --decode-batches 1,64 --decode-kernels hf,compiled,compiled-fused --cases greedy,sample ;;
    fast-decode-64) part fast-decode-64 200 "$py" profiles/fast_probe.py --out "$work/fast-decode-64/probe" --parts decode \
           --decode-batches 64 --decode-kernels compiled,compiled-fused --cases greedy,sample ;;
    select-64) part select-64 150 "$py" profiles/fast_probe.py --out "$work/select-64/probe" --parts select \
           --batches 64 --select-kernels compiled ${SELECT_VARIANTS:+--select-variants "$SELECT_VARIANTS"} ;;
    sweep) part sweep ${SWEEP_PART_SECONDS:-560} bash profiles/regenerate.sh "$work/sweep" sweep ;;
    notebooks) part notebooks ${NOTEBOOKS_PART_SECONDS:-580} bash profiles/regenerate.sh "$work/notebooks" notebooks ;;
    tests-kernels) part tests-kernels ${KERNEL_TESTS_SECONDS:-540} env GDTOOL_KERNEL_PATHS="$work/tests-kernels/paths.jsonl" \
           "$py" -m pytest -q -ra -m cuda -n ${TEST_WORKERS:-8} -p no:cacheprovider -p no:logging \
           ${KERNEL_TESTS_K:+-k "$KERNEL_TESTS_K"} tests/test_fast_kernels.py tests/test_fast_tail.py tests/test_fast_cuda.py tests/test_fast_gemma3.py tests/test_experts.py tests/test_linear.py tests/test_cuda_compile.py \
           tests/test_fast_attention.py tests/test_windows.py --deselect tests/test_windows.py::test_sliding_windows_equal_generate_captured \
           --deselect tests/test_windows.py::test_zoo_sliding_windows_with_compiled_kernels_captured \
           --deselect tests/test_experts.py::test_zoo_moe_decodes_with_fast_kernels_captured \
           --deselect tests/test_fast_kernels.py::test_fast_sweep_captured_equals_uncaptured_on_cuda
           "$py" profiles/kernel_paths.py "$work/tests-kernels/paths.jsonl" 2>&1 | tee "$work/tests-kernels/paths.txt" | tee -a "$log"
           keep tests-kernels ;;
    tests-fast-sweep) part tests-fast-sweep ${FAST_SWEEP_SECONDS:-400} env GDTOOL_KERNEL_PATHS="$work/tests-fast-sweep/paths.jsonl" \
           "$py" -m pytest -q -rfE --tb=short -m cuda -n ${TEST_WORKERS:-8} -p no:cacheprovider -p no:logging \
           tests/test_fast_kernels.py::test_fast_sweep_captured_equals_uncaptured_on_cuda
           "$py" profiles/kernel_paths.py "$work/tests-fast-sweep/paths.jsonl" 2>&1 | tee "$work/tests-fast-sweep/paths.txt" | tee -a "$log"
           keep tests-fast-sweep ;;
    fresh-compiles) part fresh-compiles ${FRESH_SECONDS:-300} bash -c "for eos in '' --eos-off; do \
           $py profiles/fresh_compiles.py --case ${FRESH_CASE:-5193} --processes ${FRESH_PROCESSES:-8} \
           --jobs ${FRESH_JOBS:-8} --modes ${FRESH_MODES:-eager step-graph device-loop} \$eos || exit 1; done" ;;
    tests-zoo-kernels) part tests-zoo-kernels ${ZOO_KERNELS_SECONDS:-560} "$py" -m pytest -q -rfE --tb=short -m cuda \
           -n ${TEST_WORKERS:-8} -p no:cacheprovider -p no:logging \
           tests/test_windows.py::test_zoo_sliding_windows_with_compiled_kernels_captured \
           tests/test_experts.py::test_zoo_moe_decodes_with_fast_kernels_captured ;;
    tests-pick) part tests-pick ${TESTS_PICK_SECONDS:-300} bash -c "$py -m pytest -q -rfE --tb=short -m cuda -p no:cacheprovider \
           -p no:logging ${TESTS_PICK:?set TESTS_PICK: the pytest arguments, e.g. tests/test_parity.py -k one_token}" ;;
    recheck) part recheck ${RECHECK_SECONDS:-150} bash -c "$py -m pytest -q -rfE --tb=short -m cuda -p no:cacheprovider \
           -p no:logging tests/test_timing.py && $py -m pytest -q -rfE --tb=short -m cuda -n ${TEST_WORKERS:-8} \
           -p no:cacheprovider -p no:logging tests/test_cuda.py tests/test_zoo.py -k 'index_lists or failed_capture or \
           host_constants or (test_zoo_captured and ((gemma3 and not gemma3n) or paligemma or shieldgemma2 or kimi_k25 or muse_glimmer))'" ;;
    windows-gpt-oss) part windows-gpt-oss ${WINDOWS_SECONDS:-400} "$py" -m pytest -q -rfE --tb=short -m cuda \
           -p no:cacheprovider -p no:logging tests/test_windows.py -k "gdtool_kernels_captured and gpt_oss" ;;
    tests-zoo) part tests-zoo ${ZOO_SECONDS:-560} env ZOO_OUTCOMES="$work/tests-zoo/outcomes.jsonl" \
           "$py" -m pytest -v -rfEs -m cuda -n ${TEST_WORKERS:-15} -p no:cacheprovider \
           tests/test_zoo.py ${ZOO_K:+-k "$ZOO_K"} ;;
    nsys-sliding-moe) part nsys-sliding-moe 400 bash -c "cp -r profiles/h200/nsys-sliding-moe $work/ && \
           $py -m gdtool profile --nsys --model qwen3-30b-a3b --batch 16 --trace graph \
           --modes eager forward-graph step-graph --max-new-tokens 48 --no-eos --no-progress --out $work/nsys-sliding-moe" ;;
    bench-qwen3-8b) part bench-qwen3-8b ${BENCH_SECONDS:-480} env GDTOOL_UNTESTED_KERNELS=1 "$py" -m gdtool bench \
           --model qwen3-8b --batch ${BENCH_BATCHES:-1,64} --repeats 2 --modes step-graph device-loop --peers gpt-fast \
           --kernels ${BENCH_KERNELS:-hf,compiled,fast} ${BENCH_FLAGS:-} --out "$work/bench-qwen3-8b" ;;
    bench-gemma) part bench-gemma ${BENCH_SECONDS:-480} env GDTOOL_UNTESTED_KERNELS=1 "$py" -m gdtool bench \
           --model gemma-3-1b --batch ${BENCH_BATCHES:-1,64} --max-new-tokens 256 --repeats 2 --modes step-graph device-loop \
           --peers generate-static --kernels ${BENCH_KERNELS:-hf,compiled,fast} ${BENCH_FLAGS:-} --out "$work/bench-gemma" ;;
    bench-gpt-oss) part bench-gpt-oss ${BENCH_SECONDS:-480} env GDTOOL_UNTESTED_KERNELS=1 "$py" -m gdtool bench \
           --model gpt-oss-20b --batch ${BENCH_BATCHES:-1} --repeats 2 --modes step-graph --peers generate-static \
           --kernels ${BENCH_KERNELS:-hf,compiled,fast} ${BENCH_FLAGS:-} --out "$work/bench-gpt-oss" ;;
    bench-moe) part bench-moe ${BENCH_SECONDS:-480} env GDTOOL_UNTESTED_KERNELS=1 "$py" -m gdtool bench \
           --model qwen3-30b-a3b --batch ${BENCH_BATCHES:-1,16} --repeats 2 --modes step-graph --peers ${BENCH_PEERS:-none} \
           --kernels ${BENCH_KERNELS:-hf,compiled,fast} ${BENCH_FLAGS:-} --out "$work/bench-moe" ;;
    bench-peers) part bench-peers ${BENCH_SECONDS:-560} bash -c "gpu=\$($py -c 'import torch; n = torch.cuda.get_device_name() \
           if torch.cuda.is_available() else \"\"; g = next((g for g in (\"h200\", \"h100\") if g in n.lower()), \"\"); \
           assert g or not n, f\"bench-peers: the table has folders for H100s and H200s only, not for {n}\"; print(g)') \
           || exit 1; test -z \"\$gpu\" -o \"\$gpu\" = \"${BENCH_GPU:-\$gpu}\" \
           || { echo \"bench-peers: this GPU is an \$gpu, and BENCH_GPU names ${BENCH_GPU:-}: leave it out\"; exit 1; }; \
           gpu=\${gpu:-${BENCH_GPU:-h100}}; \
           $py profiles/doc_tables.py --rerun \$gpu ${BENCH_AGAIN:+--again} --into $work/bench-peers | grep -E -- '--model (${BENCH_MODELS:-llama-1b}) --batch ${BENCH_BATCH:-[0-9]+} ' \
           | sed 's|^python |$py |' ${BENCH_PEERS:+| sed 's|--peers none|--peers $BENCH_PEERS|'} > $work/bench-peers/commands.txt; cat $work/bench-peers/commands.txt; \
           test -s $work/bench-peers/commands.txt || { echo 'no run of BENCH_MODELS is missing'; exit 1; }; \
           $py -c 'import torch; assert torch.cuda.is_available(), \"bench-peers: the table is of GPU runs, and no CUDA GPU is here\"' && \
           GDTOOL_UNTESTED_KERNELS=1 bash -e $work/bench-peers/commands.txt" ;;
    bench-batches) part bench-batches ${BENCH_SECONDS:-540} bash -c "m=${BATCH_MODEL:-llama-1b}; d=$work/bench-batches/\$m; \
           $py -m gdtool bench --model \$m --batch ${BENCH_BATCHES:-1,2,3,4,5,8,9,12,16,32,64} --repeats 2 --modes step-graph \
           --kernels fast --fuse-projections --peers none --no-progress --out \$d/line-default && \
           $py -m gdtool bench --model \$m \
           --batch ${COMPARE_BATCHES:-1,2,3,4} --repeats 2 --modes step-graph --kernels compiled --fuse-projections \
           --peers none --no-progress --out \$d/compiled && { $py profiles/bench_table.py --curve \$d/line-default/*.json; echo; \
           $py profiles/bench_table.py --paths \$d/*/*.json; } | tee \$d/curve.md" ;;
    bench-cublas) part bench-cublas ${BENCH_SECONDS:-400} bash -c "for m in ${CUBLAS_MODELS:-llama-8b}; do \
           $py -m gdtool bench --model \$m --batch ${COMPARE_BATCHES:-1,2,3,4} --repeats 2 --modes step-graph \
           --kernels compiled --fuse-projections --peers none --no-progress --out $work/bench-cublas/\$m || exit 1; done" ;;
    bench-line) part bench-line ${BENCH_SECONDS:-450} bash -c "for m in ${LINE_MODELS:-llama-8b}; do \
           $py profiles/plan_bench.py --gemv-rows ${LINE_ROWS:-1} -- --model \$m --batch ${BENCH_BATCHES:-2,3,4} --repeats 2 \
           --modes step-graph --peers none --kernels fast --fuse-projections --no-progress \
           --out $work/bench-line/\$m-line-${LINE_ROWS:-1} || exit 1; done" ;;
    bench-trigger) part bench-trigger ${BENCH_SECONDS:-400} bash -c "for m in ${PDL_MODELS:-llama-8b}; do for t in 0 1; do \
           GDTOOL_PDL=${TRIGGER_PDL:-1} GDTOOL_UNTESTED_KERNELS=1 $py profiles/plan_bench.py --late-trigger \$t -- \
           --model \$m --batch ${BENCH_BATCHES:-1} --max-new-tokens 256 --repeats 2 --modes step-graph --peers none \
           --kernels fast --no-progress --out $work/bench-trigger/\$m-late-\$t || exit 1; done; done" ;;
    bench-fold) part bench-fold ${BENCH_SECONDS:-400} bash -c "for m in ${FOLD_MODELS:-llama-1b gemma-3-1b}; do \
           for r in 1 2; do for f in 0 1; do GDTOOL_UNTESTED_KERNELS=1 $py profiles/plan_bench.py --fold-embedding \$f -- \
           --model \$m --batch ${BENCH_BATCHES:-1} --max-new-tokens 256 --repeats 2 --modes step-graph --peers none \
           --kernels fast --no-progress --out $work/bench-fold/\$m-fold-\$f-r\$r || exit 1; done; done; done" ;;
    bench-attention) part bench-attention ${BENCH_SECONDS:-540} bash -c "for m in ${ATTN_MODELS:-llama-1b gemma-3-1b}; do \
           for p in ${ATTN_PLANS:-1024: 4096: 8192: 1024:264}; do e=\${p%%:*}; t=\${p#*:}; GDTOOL_UNTESTED_KERNELS=1 \
           $py profiles/plan_bench.py --loop-elements \$e \${t:+--target \$t} -- --model \$m --batch ${BENCH_BATCHES:-64} \
           --max-new-tokens 256 --repeats 2 --modes step-graph --peers none --kernels fast --fuse-projections --no-progress \
           --out $work/bench-attention/\$m-loop-\$e\${t:+-target-\$t} || exit 1; done; done" ;;
    bench-sliding) part bench-sliding ${BENCH_SECONDS:-300} bash -c "for m in ${SLIDING_MODELS:-gemma-3-1b}; do \
           for v in 0 1; do GDTOOL_UNTESTED_KERNELS=1 $py profiles/plan_bench.py --sliding \$v -- --model \$m \
           --batch ${BENCH_BATCHES:-64} --max-new-tokens 256 --repeats 2 --modes step-graph --peers none --kernels fast \
           --fuse-projections --no-progress --out $work/bench-sliding/\$m-sliding-\$v || exit 1; done; done" ;;
    bench-argmax) part bench-argmax ${BENCH_SECONDS:-300} bash -c "for m in ${ARGMAX_MODELS:-llama-1b gemma-3-1b}; do \
           for v in 0 1; do GDTOOL_UNTESTED_KERNELS=1 $py profiles/plan_bench.py --argmax \$v -- --model \$m \
           --batch ${BENCH_BATCHES:-64} --max-new-tokens 256 --repeats 2 --modes step-graph --peers none --kernels fast \
           --fuse-projections --no-progress --out $work/bench-argmax/\$m-argmax-\$v || exit 1; done; done" ;;
    bench-dot) part bench-dot ${BENCH_SECONDS:-300} bash -c "for m in ${DOT_BENCH_MODELS:-llama-1b gemma-3-1b}; do \
           for v in 0 1; do GDTOOL_UNTESTED_KERNELS=1 $py profiles/plan_bench.py --dot \$v -- --model \$m \
           --batch ${BENCH_BATCHES:-64} --max-new-tokens 256 --repeats 2 --modes step-graph --peers none --kernels fast \
           --fuse-projections --no-progress --out $work/bench-dot/\$m-dot-\$v || exit 1; done; done" ;;
    bench-autotune) part bench-autotune ${BENCH_SECONDS:-540} bash -c "for m in ${AUTOTUNE_MODELS:-llama-1b gemma-3-1b}; do \
           for a in 0 1; do GDTOOL_UNTESTED_KERNELS=1 $py profiles/plan_bench.py --max-autotune \$a -- \
           --model \$m --batch ${BENCH_BATCHES:-64} --max-new-tokens 256 --repeats 2 --modes step-graph --peers none \
           --kernels fast --fuse-projections --no-progress --out $work/bench-autotune/\$m-autotune-\$a || exit 1; done; done" ;;
    bench-pdl) part bench-pdl ${BENCH_SECONDS:-300} bash -c "for m in ${PDL_MODELS:-gemma-3-1b}; do for p in 0 auto 1; do \
           GDTOOL_PDL=\$p GDTOOL_UNTESTED_KERNELS=1 $py -m gdtool bench --model \$m --batch ${BENCH_BATCHES:-1} --max-new-tokens 256 \
           --repeats 2 --modes step-graph --peers none --kernels fast --out $work/bench-pdl/\$m-pdl-\$p || exit 1; done; done" ;;
    moe-block) part moe-block 200 env GDTOOL_UNTESTED_KERNELS=1 "$py" profiles/moe_block.py --batch 1,4,16 ;;
    ncu-experts) part ncu-experts ${NCU_SECONDS:-300} bash -c "ncu=\${NCU:-\$(dirname \$(dirname \$(dirname \$(command -v nsys))))/ncu}; \
           d=$work/ncu-experts; mkdir -p \$d; \$ncu --version; export GDTOOL_UNTESTED_KERNELS=1; \
           \$ncu --target-processes all --graph-profiling node --set full -f --launch-skip 3 --launch-count 3 \
           -k regex:'^_(router|gate_up|down)_kernel' -o \$d/small-b1 $py profiles/moe_block.py --batch 1 && \
           \$ncu --target-processes all --graph-profiling node --set full -f --launch-skip 6 --launch-count 6 \
           -k regex:'^_(router|route|align|grouped_gate_up|grouped_down|combine)_kernel' -o \$d/grouped-b${NCU_GROUPED_BATCH:-64} \
           $py profiles/moe_block.py --batch ${NCU_GROUPED_BATCH:-64}; \
           for r in \$d/*.ncu-rep; do \$ncu --import \$r --page details --csv > \${r%.ncu-rep}-details.csv; done" ;;
    moe-sweep) part moe-sweep ${MOE_SWEEP_SECONDS:-500} bash -c "for m in ${MOE_SWEEP_MODELS:-qwen3-30b-a3b}; do \
           $py profiles/moe_sweep.py --model \$m ${MOE_SWEEP_BATCHES:+--batch $MOE_SWEEP_BATCHES} \
           ${MOE_SWEEP_GRIDS:+--grids $MOE_SWEEP_GRIDS} --out $work/moe-sweep ${write_config:+--write-config $write_config} \
           || exit 1; done" ;;
    attention-plan) part attention-plan ${ATTENTION_PLAN_SECONDS:-200} "$py" profiles/decode_kernels_probe.py \
           --parts attention --attention-targets ${ATTENTION_TARGETS:-8,16,33,66,132,264} --out "$work/attention-plan" \
           ${write_config:+--write-config $write_config} ;;
    tuning-check) part tuning-check 60 bash -c "g=\$(ls $work/kernels-sweep/gemv.csv 2>/dev/null); \
           m=\$(ls $work/moe-sweep/*.csv 2>/dev/null); a=\$(ls $work/attention-plan/attention.csv 2>/dev/null); \
           $py profiles/tuning_files.py --config device \${g:+--gemv \$g} \${m:+--moe \$m} \${a:+--attention \$a}" ;;
    kernels-probe) part kernels-probe 300 "$py" profiles/decode_kernels_probe.py --parts check,gemv \
           --models llama-8b,qwen3-8b,gemma-3-1b --gemv-rows 1,4,8,16 --out "$work/kernels-probe" ;;
    agree) part agree ${AGREE_SECONDS:-400} env GDTOOL_UNTESTED_KERNELS=1 "$py" profiles/decode_kernels_probe.py \
           --parts step --step-models ${AGREE_MODELS:-qwen3-30b-a3b,gpt-oss-20b} --prompt-len 32 --budget-s 360 \
           --cases $(for b in ${AGREE_BATCHES//,/ }; do printf '%s:agree:step-graph:0,' "$b"; done | sed 's/,$//') \
           --out "$work/agree" ;;
    accuracy) part accuracy ${ACCURACY_SECONDS:-300} env GDTOOL_UNTESTED_KERNELS=1 "$py" profiles/decode_kernels_probe.py \
           --parts step --step-models ${ACCURACY_MODELS:-gpt-oss-20b} --prompt-len 32 --budget-s 260 \
           --cases $(b=${ACCURACY_BATCHES:-1,16}; for x in ${b//,/ }; do printf '%s:accuracy:step-graph:0,' "$x"; done | sed 's/,$//') \
           --out "$work/accuracy" ;;
    kernels-qk) part kernels-qk ${KERNELS_QK_SECONDS:-200} "$py" profiles/decode_kernels_probe.py --parts check,gemv \
           --models gemma-3-1b,qwen3-8b --gemv-rows 1,4 --sweep none --budget-s 170 --out "$work/kernels-qk" ;;
    kernels-dot) part kernels-dot ${KERNELS_DOT_SECONDS:-300} "$py" profiles/decode_kernels_probe.py --parts gemv --dot \
           --models ${DOT_MODELS:-llama-8b,qwen3-8b,llama-1b} --sweep-models none --gemv-rows ${DOT_ROWS:-2,3,4} --sweep full \
           --budget-s $(( ${KERNELS_DOT_SECONDS:-300} - 30 )) --out "$work/kernels-dot" ;;
    kernels-sweep) part kernels-sweep ${KERNELS_SWEEP_SECONDS:-150} "$py" profiles/decode_kernels_probe.py --parts gemv \
           --models ${SWEEP_MODELS:-gemma-3-1b} --sweep-models ${SWEEP_MODELS:-gemma-3-1b} --gemv-rows ${SWEEP_ROWS:-1} --sweep full \
           --budget-s $(( ${KERNELS_SWEEP_SECONDS:-150} - 30 )) --out "$work/kernels-sweep" \
           ${write_config:+--write-config $write_config} ;;
    *) echo "unknown part $p (the parts are listed at the top of profiles/gpu_run.sh)" | tee -a "$log"
       failed+=("$p") ;;
  esac
done
keep tuning
rm -rf "$work"
# what comes back from a GPU machine is capped at 16 MiB a file: a larger tar travels gzipped, in 15 MiB pieces
# (cat results.tar.gz.* | tar -xz)
if [ "$(stat -c %s "$out/results.tar")" -gt 15728640 ]; then
  gzip -9 "$out/results.tar" && split -b 15M -d "$out/results.tar.gz" "$out/results.tar.gz." && rm "$out/results.tar.gz"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== failed: ${failed[*]}" | tee -a "$log"
  exit 1
fi
echo "=== every part passed" | tee -a "$log"
