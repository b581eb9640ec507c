"""The checks of untrusted hyperparameters: numbers, flags, heads, and whether the layers
a file declares hold tensors (at a cost independent of the declared count)."""

import math
import time

import pytest

from jaxlearn.families import Architecture, MalformedFileError
from jaxlearn.families.checks import check_heads, check_layers_present, flag, integer, number


def test_integer_number_and_flag():
    assert integer(4.0, "f", "k", high=8) == 4
    for bad, match in ((True, "not an integer"), ("4", "not an integer"),
                       (4.5, "not an integer"), (math.nan, "not an integer"),
                       (9, r"out of range \[1, 8\]"), (0, r"out of range \[1, 8\]")):  # fmt: skip
        with pytest.raises(MalformedFileError, match=f"f: k = .* {match}"):
            integer(bad, "f", "k", high=8)
    assert number(2, "f", "k") == 2.0 and number(-1.0, "f", "k", positive=False) == -1.0
    for bad in (0.0, -1.0, math.inf, math.nan, "1", False):
        with pytest.raises(MalformedFileError, match="f: k = "):
            number(bad, "f", "k")
    assert flag(None, "f", "k", True) is True and flag(False, "f", "k") is False
    for bad in ("false", 0, 1):
        with pytest.raises(MalformedFileError, match="is not true or false"):
            flag(bad, "f", "k")


def test_check_heads():
    fields = ("dim", "heads", "kv")
    assert check_heads("f", dim=32, heads=4, kv_heads=2, head_dim=None, fields=fields) == 8
    assert check_heads("f", dim=30, heads=4, kv_heads=2, head_dim=16, fields=fields) == 16
    with pytest.raises(MalformedFileError, match="heads = 4 does not divide dim = 30"):
        check_heads("f", dim=30, heads=4, kv_heads=2, head_dim=None, fields=fields)
    with pytest.raises(MalformedFileError, match="kv = 3 does not divide heads = 4"):
        check_heads("f", dim=32, heads=4, kv_heads=3, head_dim=None, fields=fields)


def hf_names(layers):
    return {f"model.layers.{i}.{n}.weight" for i in range(layers) for n in (
        "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj")} | {"model.embed_tokens.weight", "model.norm.weight"}  # fmt: skip


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_declared_layers_without_tensors_are_named_cheaply(fmt):
    def arch(layers):
        return Architecture(family="llama", vocab_size=8, dim=8, num_layers=layers, num_heads=2,
                            num_kv_heads=2, head_dim=4, ffn_dim=8, norm_eps=1e-6,
                            rope_theta=1e4, tie_embeddings=True)  # fmt: skip

    names = hf_names(2)
    if fmt == "gguf":
        names = {n.replace("model.layers.", "blk.").replace(".input_layernorm", ".attn_norm")
                 for n in names}  # fmt: skip
    kw = dict(where="f", field="num_hidden_layers", source="the file")
    check_layers_present(arch(2), "hf", hf_names(2), **kw)
    start = time.perf_counter()
    with pytest.raises(MalformedFileError) as e:
        check_layers_present(arch(100000), "hf", hf_names(2), **kw)
    assert time.perf_counter() - start < 5.0
    msg = str(e.value)
    assert msg.startswith("f: num_hidden_layers = 100000, but 99998 of those layers")
    assert "model.layers.2.input_layernorm.weight" in msg and "... and 899979 more" in msg
