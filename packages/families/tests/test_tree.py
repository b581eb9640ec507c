"""Canonical per-layer trees <-> a model's params: split then assemble is the identity for
scanned, looped and grouped (scanned Gemma) stacks; mismatches are listed."""

import jax
import numpy as np
import pytest

from jaxlearn.families import ParameterMismatchError
from jaxlearn.families.tree import assemble_params, flatten, group_size, split_params
from jaxlearn.layers import gemma2_config, llama_config


@pytest.mark.parametrize("make,p", [
    (lambda: llama_config(32, 16, 3, 2, 2, 24, stack="scan"), None),
    (lambda: llama_config(32, 16, 3, 2, 2, 24, stack="loop"), None),
    (lambda: gemma2_config(32, 16, 4, 2, 1, 24, head_dim=8, sliding_window=4), 2),
])  # fmt: skip
def test_split_then_assemble_is_the_identity(make, p):
    cfg = make()
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    assert group_size(model) == p
    top, layers = split_params(model, params)
    assert len(layers) == (4 if p else 3) and "emb" in top
    again = assemble_params(model, top, layers, source="test")
    jax.tree.map(np.testing.assert_array_equal, again, jax.device_get(params))
    layers[1]["attention_norm"]["scale"] = np.zeros(5, np.float32)
    del layers[0]["ffn_norm"]
    with pytest.raises(ParameterMismatchError) as e:
        assemble_params(model, top, layers, source="test", names={})
    assert e.value.mismatched or e.value.missing


def test_mismatches_are_all_listed_with_checkpoint_names():
    model = llama_config(32, 16, 2, 2, 2, 24, stack="loop").instantiate()
    top, layers = split_params(model, model.initialize_parameters_recursively(jax.random.key(0)))
    layers[1]["attention_norm"]["scale"] = np.zeros(5, np.float32)
    del layers[0]["ffn_norm"]
    layers[0]["extra"] = np.zeros(2)
    path = "decoder.transformer.layer1.attention_norm.scale"
    with pytest.raises(ParameterMismatchError) as e:
        assemble_params(model, top, layers, source="ckpt", names={path: "blk.1.attn_norm"})
    assert e.value.missing == ["decoder.transformer.layer0.ffn_norm.scale"]
    assert e.value.unexpected == ["decoder.transformer.layer0.extra"]
    assert e.value.mismatched == [f"{path} (checkpoint: blk.1.attn_norm): got (5,), expected (16,)"]
    assert set(flatten({"a": {"b": 1}, "c": 2})) == {"a.b", "c"}
