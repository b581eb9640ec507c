#!/usr/bin/env bash
# One-command performance suite: jaxlearn vs PyTorch + HF transformers on this machine.
#
#   tools/bench/run.sh                 # everything (about an hour on 2 idle cores)
#   tools/bench/run.sh --quick         # one repeat of each measurement, shorter runs
#   tools/bench/run.sh --only peak,train --repeats 3
#   tools/bench/run.sh --report        # only rebuild summary.md and the plots
#
# Two virtual environments, created on first use and cached under ~/.cache/jaxlearn/:
# - the JAX side: the pinned project requirements (third_party/python/requirements.txt,
#   the same pins as tools/jaxlearn and the Pants lockfile) plus the bench-only extras in
#   tools/bench/requirements-bench.txt (matplotlib), keyed by the hash of both files;
# - the peer: torch (CPU build), transformers, safetensors, numpy
#   (tools/bench/requirements-torch.txt), keyed by its hash.
# Override with JAXLEARN_BENCH_VENV / JAXLEARN_TORCH_VENV (e.g. an existing venv).
#
# Results: tools/bench/results/*.jsonl (one JSON object per measurement, each from its own
# process), tools/bench/results/summary.md (the tables) and tools/bench/results/*.png.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/jaxlearn"
REQS="$ROOT/third_party/python/requirements.txt"
BENCH_REQS="$HERE/requirements-bench.txt"
TORCH_REQS="$HERE/requirements-torch.txt"
JHASH="$(cat "$REQS" "$BENCH_REQS" | sha256sum | cut -c1-12)"
THASH="$(sha256sum "$TORCH_REQS" | cut -c1-12)"
JVENV="${JAXLEARN_BENCH_VENV:-$CACHE/bench-venv-$JHASH}"
TVENV="${JAXLEARN_TORCH_VENV:-$CACHE/torch-venv-$THASH}"

find_python311() {
  local c
  for c in "${JAXLEARN_PYTHON:-}" python3.11 "$HOME"/.pyenv/versions/3.11*/bin/python3.11 python3; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

make_venv() {  # make_venv DIR REQ_FILE...
  local dir="$1"; shift
  [ -f "$dir/.ok" ] && return 0
  local py
  py="$(find_python311)" || { echo "bench: Python 3.11 not found (set JAXLEARN_PYTHON)" >&2; exit 1; }
  echo "[bench] creating $dir ($*)" >&2
  mkdir -p "$(dirname "$dir")"
  rm -rf "$dir"
  "$py" -m venv "$dir"
  local r
  for r in "$@"; do
    "$dir/bin/pip" install --quiet --disable-pip-version-check -r "$r" 2>&1 \
      | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  done
  touch "$dir/.ok"
}

make_venv "$JVENV" "$REQS" "$BENCH_REQS"
make_venv "$TVENV" "$TORCH_REQS"

PYTHONPATH="$(printf '%s:' "$ROOT"/packages/*/src)$HERE:${PYTHONPATH:-}"
export PYTHONPATH
export BENCH_JAX_PYTHON="$JVENV/bin/python" BENCH_TORCH_PYTHON="$TVENV/bin/python"
# The same glibc malloc settings as tools/jaxlearn, for both sides (tools/malloc_env.sh).
# shellcheck source=tools/malloc_env.sh
. "$ROOT/tools/malloc_env.sh"
cd "$ROOT"
exec "$JVENV/bin/python" "$HERE/suite.py" "$@"
