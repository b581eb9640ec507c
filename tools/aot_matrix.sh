#!/usr/bin/env bash
# The AOT matrix: compiles every real-size recipe for every accelerator family's golden
# selector with `jaxlearn aot`, one pair at a time, records each verdict in
# docs/aot_matrix.json (or $JAXLEARN_AOT_MATRIX) and rewrites docs/aot_matrix.md from it.
# A pair's row is replaced when it is compiled again; the others stay. Exit status: the
# number of pairs of this run that do not fit or fail to compile (0: everything fits).
#   tools/aot_matrix.sh                          # all of them (hours on a small CPU)
#   tools/aot_matrix.sh llama2-7b gpu-h100-8x4   # one pair; lists are space-separated
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JL="$ROOT/tools/jaxlearn"
MATRIX="${JAXLEARN_AOT_MATRIX:-$ROOT/docs/aot_matrix.json}"
recipes=${1:-$("$JL" python -c "from jaxlearn.experiments import REAL_SIZE; print(*REAL_SIZE)")}
selectors=${2:-$("$JL" python -c \
  "from jaxlearn.experiments import SELECTORS; print(*(s for s in SELECTORS if s != 'cpu-8'))")}
bad=0
for r in $recipes; do
  for s in $selectors; do
    "$JL" aot-matrix run --matrix "$MATRIX" --experiment "$r" --mesh_selector "$s" \
      || bad=$((bad + 1))
  done
done
"$JL" aot-matrix render --matrix "$MATRIX" >/dev/null
exit "$bad"
