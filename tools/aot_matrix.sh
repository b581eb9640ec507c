#!/usr/bin/env bash
# AOT-compiles every recipe for every hardware family (the golden selectors) and prints one
# verdict line per pair; the JSON reports go to ${OUT:-aot_matrix}/. Exit status: the number
# of pairs that do not fit or fail to compile (0: everything fits).
#   tools/aot_matrix.sh                      # all recipes x all selectors
#   tools/aot_matrix.sh llama2-7b tpu-v5p-512
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-aot_matrix}"
mkdir -p "$OUT"
recipes=${1:-$("$ROOT/tools/jaxlearn" experiments | awk '{print $1}')}
selectors=${2:-$("$ROOT/tools/jaxlearn" python -c \
  "from jaxlearn.experiments import SELECTORS; print(' '.join(SELECTORS))")}
bad=0
for r in $recipes; do
  for s in $selectors; do
    if "$ROOT/tools/jaxlearn" aot --experiment "$r" --mesh_selector "$s" --json \
        > "$OUT/$r@$s.json" 2> "$OUT/$r@$s.err"; then
      echo "FITS      $r @ $s"
    else
      echo "NO        $r @ $s ($(tail -1 "$OUT/$r@$s.err"))"; bad=$((bad + 1))
    fi
  done
done
exit "$bad"
