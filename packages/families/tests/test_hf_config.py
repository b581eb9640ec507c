"""HF config.json dicts <-> `Architecture`: every family's `hf_config_dict` reads back
equal; RoPE and Gemma fields take HF's defaults; bad values are one-line errors naming
the field."""

import pytest

from jaxlearn.families import (
    HF_CLASSES,
    Architecture,
    MalformedFileError,
    UnsupportedModelError,
    architecture_from_config,
    architecture_from_hf,
    hf_config_dict,
)
from jaxlearn.layers import gemma2_config, gemma3_config, llama_config, phi3_config

LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                             "beta_fast": 8.0, "original_max_position_embeddings": 16}}
PHI3 = {"model_type": "phi3", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 80,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "original_max_position_embeddings": 16,
        "sliding_window": 6,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                            "partial_rotary_factor": 0.5,
                            "long_factor": [1.0, 2.5, 6.0, 11.0],
                            "short_factor": [1.0, 1.1, 1.3, 1.6]}}  # fmt: skip


def test_every_family_round_trips_through_its_config_json():
    seen = set()
    for arch in (
        architecture_from_hf(LLAMA),
        architecture_from_hf(PHI3),
        architecture_from_hf(dict(LLAMA, model_type="qwen3", rope_parameters=None)),
        architecture_from_hf(dict(LLAMA, model_type="qwen2", rope_parameters=None,
                                  use_sliding_window=True, sliding_window=4,
                                  max_window_layers=1)),
        architecture_from_hf(dict(LLAMA, model_type="mistral", sliding_window=5)),
        architecture_from_hf(dict(LLAMA, model_type="mixtral", num_local_experts=4)),
        architecture_from_hf(dict(LLAMA, model_type="qwen3_moe", num_experts=4,
                                  moe_intermediate_size=16, mlp_only_layers=[1],
                                  norm_topk_prob=True)),
        architecture_from_config(gemma2_config(96, 32, 4, 4, 2, 48, head_dim=8,
                                               sliding_window=4)),
        architecture_from_config(gemma3_config(96, 32, 7, 4, 1, 48, head_dim=8)),
    ):  # fmt: skip
        hf = hf_config_dict(arch)
        assert hf["architectures"] == [HF_CLASSES[arch.family]]
        again = architecture_from_hf(hf)
        assert again == Architecture(**dict(vars(arch), max_position_embeddings=hf[
            "max_position_embeddings"])), arch.family  # fmt: skip
        seen.add(arch.family)
    assert seen == set(HF_CLASSES)


def test_defaults_are_filled_in():
    phi3 = architecture_from_hf(PHI3)
    assert phi3.rotary_fraction == 0.5 and phi3.sliding_windows == (6,) * 3
    assert phi3.rope_scaling["factor"] == 4.0  # max / original positions, as HF
    g2 = architecture_from_hf({**LLAMA, "model_type": "gemma2", "rope_parameters": None,
                               "hidden_activation": "gelu_pytorch_tanh"})  # fmt: skip
    assert (g2.query_pre_attn_scalar, g2.attn_logit_soft_cap, g2.final_logit_soft_cap) == (
        256, 50.0, 30.0)
    assert g2.sliding_windows == (4096, None) and g2.tie_embeddings is False
    g3 = architecture_from_hf({**LLAMA, "model_type": "gemma3_text", "rope_parameters": None,
                               "num_hidden_layers": 7})  # fmt: skip
    assert g3.sliding_windows == (4096,) * 5 + (None, 4096) and g3.local_rope_theta == 1e4
    assert g3.attn_logit_soft_cap is None


@pytest.mark.parametrize("edit,error,match", [
    (dict(hidden_size=0), MalformedFileError, r"hidden_size = 0 is out of range \[1, "),
    (dict(vocab_size="96"), MalformedFileError, "vocab_size = '96' is not an integer"),
    (dict(num_key_value_heads=3), MalformedFileError, "num_key_value_heads = 3 does not divide"),
    (dict(tie_word_embeddings="false"), MalformedFileError, "is not true or false"),
    (dict(model_type="gpt2"), UnsupportedModelError, "model_type 'gpt2'"),
    (dict(hidden_act="gelu"), UnsupportedModelError, "hidden_act 'gelu'"),
    (dict(partial_rotary_factor=0.5), UnsupportedModelError, "partial_rotary_factor != 1 needs"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": "4", "rope_theta": 1e4}),
     MalformedFileError, "rope_scaling.factor = '4' is not a number"),
    (dict(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}),
     UnsupportedModelError, "RoPE scaling 'proportional' is not supported"),
    (dict(model_type="gemma2", hidden_act=None, layer_types=["full_attention"]),
     MalformedFileError, "layer_types is not a list of num_hidden_layers = 2 entries"),
    (dict(model_type="gemma2", hidden_act=None, attn_logit_softcapping=-1.0),
     MalformedFileError, "attn_logit_softcapping = -1.0 must be a finite number > 0"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True),
     UnsupportedModelError, "use_bidirectional_attention is not supported"),
    (dict(model_type="gemma3", text_config=[]),
     MalformedFileError, "model_type 'gemma3' without a text_config object"),
    (dict(model_type="gemma3", text_config={"hidden_size": 0}),
     MalformedFileError, r"hidden_size = 0 is out of range \[1, "),
])  # fmt: skip
def test_bad_fields_are_one_line_errors_naming_the_field(edit, error, match):
    with pytest.raises(error, match=match) as e:
        architecture_from_hf({**LLAMA, **edit}, where="dir/config.json")
    assert str(e.value).startswith("dir/config.json: ") and "\n" not in str(e.value)


def test_bad_longrope_factors_are_refused():
    short = dict(PHI3, rope_parameters=dict(PHI3["rope_parameters"], short_factor=[1.0, 2.0]))
    with pytest.raises(MalformedFileError, match="short_factor is not a list of 4 numbers"):
        architecture_from_hf(short)
    assert architecture_from_config(llama_config(96, 32, 1, 4, 4, 48)).family == "llama"
    assert architecture_from_config(
        phi3_config(96, 64, 1, 4, 2, 80, rotary_fraction=0.5)).family == "phi3"
