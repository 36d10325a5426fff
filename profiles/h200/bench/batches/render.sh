#!/usr/bin/env bash
# Renders curves.md from the bench files beside it: bash profiles/h200/bench/batches/render.sh (any Python with
# pandas; PYTHON picks it).
set -euo pipefail
cd "$(dirname "$0")"
py=${PYTHON:-python3}
table="$py ../../../bench_table.py"
{
echo "# The batch curve of the fast step (H200; step-graph, kernels=\"fast\", fused projections, prompt 128, 256 new tokens, greedy, EOS off)"; echo
echo "Rendered by \`bash profiles/h200/bench/batches/render.sh\` (\`bench_table.py --curve | --paths\` over the files beside this one); the commands and commits of the runs are in profiles/h200/README.md (nineteenth session)."; echo
for m in llama-1b llama-8b; do
  echo "## $m"; echo; echo "### At 5a2de9b: the matrix-vector kernels to 8 rows (two passes of 4 at 5-8)"; echo
  $table --curve $m/5a2de9b/line-8/*.json; echo
  echo "### The line at one pass of 4 rows (edef802)"; echo
  echo "1-4 rows: the matrix-vector kernels (5a2de9b's files: the same code at <= 4 rows); 5-64 the compiled matmuls (5 and 8 run at edef802; 9-64 5a2de9b's files, the same code)."; echo
  $table --curve $(ls $m/5a2de9b/line-8/*_b[1-4]_*.json $m/5a2de9b-gemv-line/line-8/*_b[1-4]_*.json) \
    $m/edef802/line-4/*.json $(ls $m/5a2de9b/line-8/*_b{9,12,16,32,64}_*.json); echo
done
echo "## 1-4 rows: the fast forward against the compiled HF forward whose linear layers run the same matrix-vector kernel (\`plan_bench.py --gemv-rows 0\`: \`linear.py\`'s swap takes <= 4 rows; not cuBLAS), each run apart"; echo
$table --paths */5a2de9b-gemv-line/line-*/*.json llama-*/5a2de9b/line-8/*_b[124]_*.json; echo
echo "## llama-1b, 9-16 rows: passes of 4 rows (the line moved to 16) against the compiled matmuls"; echo
$table --paths llama-1b/5a2de9b/line-*/*_b{9,12,16}_*.json
} > curves.md
