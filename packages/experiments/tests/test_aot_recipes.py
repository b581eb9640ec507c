"""Every recipe AOT-compiles its train step for a multi-device target on
a small fake CPU mesh, at its real model size, with per-device state ~ 1/8 of the total.

The full matrix of recipes x hardware targets: `tools/aot_matrix.sh`.
"""

import jax
import numpy as np
import pytest

from jaxlearn.aot.compile import aot_compile, resolve_target
from jaxlearn.experiments import EXPERIMENTS
from jaxlearn.mesh import apply_mesh_rules
from jaxlearn.module import is_spec

# Real model sizes; a short sequence and a batch of 8 keep the CPU compile quick.
SMALL_BATCH = ["input.seq_len=64", "input.global_batch_size=8"]


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_recipe_aot_compiles_on_fake_8_device_mesh(name):
    from jaxlearn.config import apply_overrides

    cfg, _ = apply_mesh_rules(EXPERIMENTS[name](), "cpu-8")
    apply_overrides(cfg, SMALL_BATCH)
    report = aot_compile(cfg, resolve_target("cpu-8"))
    train = report.train
    assert train.flops > 0 and train.argument_bytes > 0
    # State per device is the full state / 8 under the recipe's FSDP/DP rule (+ replicas).
    model = cfg.model.clone(name="model").instantiate()
    n_params = sum(int(np.prod(s.shape)) for s in
                   jax.tree.leaves(model.create_parameter_specs_recursively(), is_leaf=is_spec))
    full_state = 3 * 4 * n_params  # f32 params + Adam mu, nu
    per_device = train.argument_bytes
    if name.startswith("tiny"):  # Data parallel on CPU: the state is replicated.
        assert per_device >= full_state * 0.9
    else:  # FSDP over 8 devices.
        assert full_state / 8 * 0.9 <= per_device <= full_state / 8 * 1.2, (per_device, n_params)
