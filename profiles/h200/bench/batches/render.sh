#!/usr/bin/env bash
# Renders curves.md from the bench files beside it: bash profiles/h200/bench/batches/render.sh (any Python with
# pandas; PYTHON picks it).
set -euo pipefail
cd "$(dirname "$0")"
py=${PYTHON:-python3}
table="$py ../../../bench_table.py"
{
echo "# The batch curve of the fast step (H200; step-graph, kernels=\"fast\", fused projections, prompt 128, 256 new tokens, greedy, EOS off)"; echo
echo "Rendered by \`bash profiles/h200/bench/batches/render.sh\` (\`bench_table.py --curve | --paths\` over the files beside this one); the commands and commits of the runs are in docs/history.md (the nineteenth and twentieth H200 sessions)."; echo
echo "## The line per shape (twentieth session): the kernels at 1-2 rows up to hidden size 2048 (llama-1b), at 1 row wider (llama-8b, qwen3-8b)"; echo
cat <<'TEXT'
Each curve combines the files of the code the default runs at each batch: the kernels at 1 row (and 2 for llama-1b) from 5a2de9b; the compiled forward with cuBLAS's products past the line from 6a6ed8e (`plan_bench.py --gemv-rows 1`: at 2-4 rows what the default runs there now), edef802 (5 and 8 rows) and 5a2de9b (9-64; qwen3-8b's 16 from 5a2de9b's line-0 run, no swap past 4 rows); qwen3-8b's 64 from profiles/h200/bench/qwen3-8b (57347d7). qwen3-8b at 5-12 and 32 rows: not run.

TEXT
for m in llama-1b llama-8b qwen3-8b; do
  echo "### $m"; echo
  # default-line.txt: the files of each preset's default curve (the notebook reads the same list)
  $table --curve @default-line.txt:$m; echo
done
echo "### 2-4 rows: the kernels against the compiled forward with cuBLAS's products (the line at 1), each run apart"; echo
echo "llama-1b's kernels from 5a2de9b, the 8B shapes' from 763504d (bench-chunk's whole rows)."; echo
$table --paths llama-1b/5a2de9b/line-8/*_b[234]_*.json llama-1b/5a2de9b-gemv-line/line-8/*_b3_*.json \
  llama-1b/6a6ed8e/line-1/*.json {llama-8b,qwen3-8b}/763504d/chunk-0/*.json {llama-8b,qwen3-8b}/6a6ed8e/line-1/*.json; echo
echo "### kernels=\"compiled\" (HF's attention, cuBLAS; no swap) at 2-4 rows, llama-8b (763504d, bench-cublas)"; echo
$table llama-8b/763504d/cublas/*.json; echo
echo "### K in chunks (GDTOOL_GEMV_CHUNK, taken out after this run) at 2-4 rows (763504d, bench-chunk): chunk-0 is whole rows"; echo
for m in llama-8b qwen3-8b; do for w in 0 2048 1024; do [ -d $m/763504d/chunk-$w ] || continue
  echo "$m, chunks of $w (0: whole rows):"; echo; $table $m/763504d/chunk-$w/*.json; echo; done; done
echo "## Earlier lines"; echo
for m in llama-1b llama-8b; do
  echo "### $m"; echo; echo "#### At 5a2de9b: the matrix-vector kernels to 8 rows (two passes of 4 at 5-8)"; echo
  $table --curve $m/5a2de9b/line-8/*.json; echo
  echo "#### The line at one pass of 4 rows (edef802)"; echo
  echo "1-4 rows: the matrix-vector kernels (5a2de9b's files: the same code at <= 4 rows); 5-64 the compiled matmuls (5 and 8 run at edef802; 9-64 5a2de9b's files, the same code)."; echo
  $table --curve $(ls $m/5a2de9b/line-8/*_b[1-4]_*.json $m/5a2de9b-gemv-line/line-8/*_b[1-4]_*.json) \
    $m/edef802/line-4/*.json $(ls $m/5a2de9b/line-8/*_b{9,12,16,32,64}_*.json); echo
done
echo "## 1-4 rows: the fast forward against the compiled HF forward whose linear layers run the same matrix-vector kernel (\`plan_bench.py --gemv-rows 0\`: \`linear.py\`'s swap takes <= 4 rows; not cuBLAS), each run apart"; echo
$table --paths */5a2de9b-gemv-line/line-*/*.json llama-*/5a2de9b/line-8/*_b[124]_*.json; echo
echo "## llama-1b, 9-16 rows: passes of 4 rows (the line moved to 16) against the compiled matmuls"; echo
$table --paths llama-1b/5a2de9b/line-*/*_b{9,12,16}_*.json
} > curves.md
