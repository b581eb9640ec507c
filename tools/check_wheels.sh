#!/usr/bin/env bash
# End-to-end packaging check, in fresh virtual environments outside the checkout:
#   1. `pip install ./packages/layers` alone gives a working jaxlearn.layers with jax (its
#      jaxlearn dependencies, config and module, come from this checkout; a 2-layer Llama's
#      loss is computed on CPU);
#   2. `pip install ./packages/cli` alone gives a `jaxlearn` command that runs
#      `jaxlearn experiments` (every jaxlearn package it needs comes from this checkout);
#   3. the wheels from `./pants package ::` name their jaxlearn dependencies by plain name (no
#      `file:` reference in any METADATA), install together and provide `jaxlearn`.
# Needs python3.11 and a reachable package index (jax and the other requirements are
# installed from it); takes several minutes. Usage: tools/check_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3.11}"
WORK="$(mktemp -d /tmp/jaxlearn-check-wheels.XXXXXX)"
# pip builds a source directory in place (build/, src/*.egg-info); stale copies there could
# reach a later wheel, so they are removed before and after.
clean() {
  rm -rf "$ROOT"/packages/*/build "$ROOT"/packages/*/src/*.egg-info
}
trap 'rm -rf "$WORK"; clean' EXIT
clean
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH JAXLEARN_DEPENDENCIES

step() { echo "[check_wheels] $*" >&2; }
fail() { echo "[check_wheels] FAILED: $*" >&2; exit 1; }
# installed NAME...: fail unless each distribution is installed in venv $1.
installed() {
  local venv=$1; shift
  local list; list=$("$venv/bin/pip" list 2>/dev/null)
  for dist in "$@"; do
    grep -qE "^$dist " <<<"$list" || fail "$dist is not installed in $venv"
  done
  grep -E "^(jax|jaxlib|jaxlearn-[a-z]+) " <<<"$list" >&2
}
# experiments VENV: `jaxlearn experiments` from VENV lists tiny-llama.
experiments() {
  local out; out=$(cd "$WORK" && "$1/bin/jaxlearn" experiments)
  echo "$out"
  grep -q "tiny-llama" <<<"$out" || fail "jaxlearn experiments ($1) did not list tiny-llama"
}

step "1/3 pip install ./packages/layers into $WORK/layers-venv"
"$PY" -m venv "$WORK/layers-venv"
"$WORK/layers-venv/bin/pip" install -q "$ROOT/packages/layers"
installed "$WORK/layers-venv" jax jaxlib jaxlearn-layers jaxlearn-module jaxlearn-config
(cd "$WORK" && "$WORK/layers-venv/bin/python" - <<'PY'
import jax
import jax.numpy as jnp

import jaxlearn.layers
from jaxlearn.layers import llama_config
from jaxlearn.module import functional

assert "site-packages" in jaxlearn.layers.__file__, jaxlearn.layers.__file__
cfg = llama_config(64, 32, 2, 4, 2, 64, rope_theta=10000.0)
model = cfg.instantiate()
params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
ids = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, 64)
batch = {"input_ids": ids, "target_labels": jnp.roll(ids, -1, axis=1)}
(loss, _), _ = functional(model, jax.random.PRNGKey(2), params, (batch,), is_training=False)
assert jnp.isfinite(loss) and 3.0 < float(loss) < 5.5, loss  # about ln 64 = 4.16 at init
print(f"jaxlearn.layers {jaxlearn.layers.__file__} on jax {jax.__version__}: loss {float(loss):.3f}")
PY
)

step "2/3 pip install ./packages/cli into $WORK/cli-venv"
clean
"$PY" -m venv "$WORK/cli-venv"
"$WORK/cli-venv/bin/pip" install -q "$ROOT/packages/cli"
installed "$WORK/cli-venv" jaxlearn-cli jaxlearn-experiments jaxlearn-runtime jaxlearn-text
experiments "$WORK/cli-venv"

step "3/3 ./pants package :: and pip install the wheels into $WORK/wheels-venv"
clean
rm -rf "$ROOT/dist"
(cd "$ROOT" && PANTS_PANTSD=false ./pants package :: >&2)
wheels=("$ROOT"/dist/jaxlearn_*.whl)
packages=$(ls -d "$ROOT"/packages/*/pyproject.toml | wc -l)
[ "${#wheels[@]}" -eq "$packages" ] || fail "expected $packages wheels, got ${#wheels[@]}"
for whl in "${wheels[@]}"; do
  requires=$(unzip -p "$whl" '*.dist-info/METADATA' | grep "^Requires-Dist: " || true)
  ! grep -E " @ |file:" <<<"$requires" \
    || fail "$(basename "$whl"): a Requires-Dist in METADATA is a direct (file:) reference"
  [ -n "$requires" ] || [[ "$whl" == */jaxlearn_config-* ]] \
    || fail "$(basename "$whl"): METADATA has no Requires-Dist"
done
unzip -p "$ROOT"/dist/jaxlearn_layers-*.whl '*.dist-info/METADATA' \
  | grep -q "^Requires-Dist: jaxlearn-config<0.2,>=0.1$" \
  || fail "jaxlearn_layers METADATA does not require jaxlearn-config by name"
"$PY" -m venv "$WORK/wheels-venv"
"$WORK/wheels-venv/bin/pip" install -q "${wheels[@]}"
experiments "$WORK/wheels-venv"
step "ok: ./packages/layers and ./packages/cli install alone from the checkout;" \
  "${#wheels[@]} wheels with plain requirements install together; jaxlearn runs"
