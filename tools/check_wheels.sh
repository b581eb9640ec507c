#!/usr/bin/env bash
# End-to-end packaging check, in fresh virtual environments outside the checkout:
#   1. `pip install ./packages/config ./packages/module ./packages/layers` gives a working
#      jaxlearn.layers with jax (a 2-layer Llama's loss computed on CPU);
#   2. the wheels from `./pants package ::` install together and provide a `jaxlearn`
#      console script that runs `jaxlearn experiments`.
# Needs python3.11 and a reachable package index (jax and the other requirements are
# installed from it); takes a few minutes. Usage: tools/check_wheels.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3.11}"
WORK="$(mktemp -d /tmp/jaxlearn-check-wheels.XXXXXX)"
LOCAL=(config module layers)
# pip builds a source directory in place (build/, src/*.egg-info); stale copies there could
# reach a later wheel, so they are removed before and after.
clean() {
  for p in "${LOCAL[@]}"; do rm -rf "$ROOT/packages/$p/build" "$ROOT/packages/$p"/src/*.egg-info; done
}
trap 'rm -rf "$WORK"; clean' EXIT
clean
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH

step() { echo "[check_wheels] $*" >&2; }

step "1/2 pip install ./packages/{config,module,layers} into $WORK/layers-venv"
"$PY" -m venv "$WORK/layers-venv"
"$WORK/layers-venv/bin/pip" install -q "${LOCAL[@]/#/$ROOT/packages/}"
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
"$WORK/layers-venv/bin/pip" list 2>/dev/null | grep -E "^(jax|jaxlib|jaxlearn-[a-z]+) " >&2

step "2/2 ./pants package :: and pip install the wheels into $WORK/wheels-venv"
rm -rf "$ROOT/dist"
(cd "$ROOT" && PANTS_PANTSD=false ./pants package :: >&2)
count=$(ls "$ROOT"/dist/jaxlearn_*.whl | wc -l)
packages=$(ls -d "$ROOT"/packages/*/pyproject.toml | wc -l)
[ "$count" -eq "$packages" ] || { echo "expected $packages wheels, got $count" >&2; exit 1; }
"$PY" -m venv "$WORK/wheels-venv"
"$WORK/wheels-venv/bin/pip" install -q "$ROOT"/dist/jaxlearn_*.whl
out=$(cd "$WORK" && "$WORK/wheels-venv/bin/jaxlearn" experiments)
echo "$out"
grep -q "tiny-llama" <<<"$out" || { echo "jaxlearn experiments did not list tiny-llama" >&2; exit 1; }
step "ok: $count wheels installed; jaxlearn.layers works from ./packages; jaxlearn runs"
