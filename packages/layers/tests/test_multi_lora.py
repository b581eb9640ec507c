"""`MultiLoraLinear` (multi_lora.py): each row of a batch computes with the adapter of its
slot exactly what the model with that adapter merged in (`merge_lora`) computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.layers import llama_config, merge_lora, use_lora, use_multi_lora, with_base_params
from jaxlearn.layers.multi_lora import ADAPTER_ROWS, adapter_arrays, write_adapter
from jaxlearn.module import functional


def logits(cfg, params, ids, rows=None):
    side = None if rows is None else {ADAPTER_ROWS: jnp.asarray(rows, jnp.int32)}
    out, _ = functional(cfg.instantiate(), None, params, ({"input_ids": ids},),
                        method="logits", is_training=False, side_inputs=side)
    return np.asarray(out)


@pytest.mark.parametrize("stack", ["loop", "scan"])
def test_rows_use_their_slots_adapter(stack):
    cfg = llama_config(64, 32, 2, 4, 2, 64, rope_theta=1e4, stack=stack).clone(name="model")
    base = cfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(0))
    mcfg, mparams = use_multi_lora(cfg, base, slots=4, max_rank=8)
    model = mcfg.instantiate()
    merged = [(cfg, base)]
    for slot, rank in ((1, 3), (3, 8)):  # Slot 2 stays empty.
        lcfg = use_lora(cfg, rank=rank, alpha=2.0)
        lp = lcfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(slot))
        lp = jax.tree_util.tree_map_with_path(
            lambda p, x: (jax.random.normal(jax.random.PRNGKey(7), x.shape) * 0.3
                          if "lora_b" in jax.tree_util.keystr(p) else x), lp)
        lp = with_base_params(lp, base)
        arrays = adapter_arrays(model, mparams, lp, rank=rank, alpha=2.0)
        mparams = write_adapter(mparams, arrays, slot)
        merged.append(merge_lora(lcfg, lp))
    ids = np.random.default_rng(0).integers(3, 60, (5, 12)).astype(np.int32)
    rows = [0, 1, 3, 2, 1]
    got = logits(mcfg, mparams, ids, rows)
    want = {0: merged[0], 1: merged[1], 3: merged[2], 2: merged[0]}
    for r, slot in enumerate(rows):
        ref = logits(*want[slot], ids[r : r + 1])[0]
        np.testing.assert_allclose(got[r], ref, atol=2e-5, rtol=0)
    assert not np.allclose(got[1], got[0], atol=1e-2)  # The adapters matter.
    # Without the side input every row is the base model.
    np.testing.assert_allclose(logits(mcfg, mparams, ids), logits(cfg, base, ids), atol=1e-6)
    with pytest.raises(ValueError, match="adapter rows"):
        logits(mcfg, mparams, ids, [0, 1])
