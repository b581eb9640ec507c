"""`Architecture` <-> `CausalLM.Config`: every family's recipe reads back as that family
and rebuilds an equal config; what no HF class can express is refused naming the config
path."""

import pytest

from jaxlearn.config import replace_config
from jaxlearn.families import (
    Architecture,
    UnsupportedModelError,
    architecture_from_config,
    build_config,
    layer_configs,
)
from jaxlearn.layers import (
    FeedForward,
    LoopStack,
    RMSNorm,
    gemma2_config,
    gemma3_config,
    llama_config,
    phi3_config,
    qwen3_config,
)
from jaxlearn.layers.moe import MixtureOfExperts

SIZES = dict(vocab_size=64, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_dim=48)


def mixtral(stack):
    moe = MixtureOfExperts.default_config().set(
        num_experts=4, num_experts_per_token=2, router_scores="softmax", capacity_factor=None,
        dropless_method="ragged_dot", normalize_top_k_weights=True)  # fmt: skip
    return replace_config(llama_config(**SIZES, stack=stack, family="mixtral"), FeedForward, moe)


RECIPES = {
    "llama": lambda stack: llama_config(**SIZES, stack=stack, rope_theta=5e5),
    "mistral": lambda stack: llama_config(**SIZES, stack=stack, family="mistral"),
    "qwen3": lambda stack: qwen3_config(**SIZES, head_dim=16, stack=stack),
    "phi3": lambda stack: phi3_config(**SIZES, rotary_fraction=0.5, stack=stack),
    "mixtral": mixtral,
    "gemma2": lambda stack: gemma2_config(**SIZES, head_dim=8, sliding_window=8, stack=stack),
    "gemma3_text": lambda stack: gemma3_config(**dict(SIZES, num_layers=7), head_dim=8,
                                               stack=stack),  # fmt: skip
}


def windowed(cfg):
    cfg.decoder.transformer.layer.self_attention.sliding_window = 6
    return cfg


@pytest.mark.parametrize("family", RECIPES)
@pytest.mark.parametrize("stack", ["scan", "loop"])
def test_recipes_read_back_as_their_family_and_rebuild(family, stack):
    cfg = RECIPES[family](stack)
    if family == "mistral":
        cfg = windowed(cfg)
    arch = architecture_from_config(cfg)
    assert arch.family == family
    again = build_config(arch, stack=stack)  # head_dim etc. explicit: the canonical form
    assert architecture_from_config(again) == arch
    assert build_config(architecture_from_config(again), stack=stack) == again
    assert again.decoder.transformer.klass is cfg.decoder.transformer.klass


def test_gemma_recipes_read_back_with_their_defaults():
    g2 = gemma2_config(256, 64, 6, 4, 2, 96, head_dim=16, sliding_window=8)
    a = architecture_from_config(g2)
    assert (a.family, a.query_pre_attn_scalar, a.attn_logit_soft_cap) == ("gemma2", 256, 50.0)
    assert a.sliding_windows == (8, None) * 3 and a.final_logit_soft_cap == 30.0
    assert build_config(a, stack="scan") == g2
    g3 = gemma3_config(256, 64, 8, 4, 1, 96, head_dim=16, stack="scan")
    assert g3.decoder.transformer.klass is LoopStack  # 8 layers: no whole 6-layer group
    a = architecture_from_config(g3)
    assert (a.family, a.rope_theta, a.local_rope_theta) == ("gemma3_text", 1e6, 1e4)
    assert a.sliding_windows == (1024,) * 5 + (None, 1024, 1024)
    assert build_config(a, stack="scan") == g3
    assert len(layer_configs(g3.decoder.transformer)) == 8


def test_per_layer_windows_and_dense_layers_give_a_loop_stack():
    arch = Architecture(family="qwen2", vocab_size=64, dim=32, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=8, ffn_dim=48, norm_eps=1e-6, rope_theta=1e4,
                        qkv_bias=True, sliding_windows=(None, 5, 5))  # fmt: skip
    cfg = build_config(arch, stack="scan")
    assert cfg.decoder.transformer.klass is LoopStack
    windows = [lc.self_attention.sliding_window for lc in layer_configs(cfg.decoder.transformer)]
    assert windows == [None, 5, 5] and architecture_from_config(cfg) == arch


def test_bad_architectures_are_refused():
    base = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=3, head_dim=8,
                ffn_dim=48, norm_eps=1e-6, rope_theta=1e4)  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="num_heads=4 is not a multiple of num_kv"):
        Architecture(family="llama", **base)
    with pytest.raises(UnsupportedModelError, match="family 'gpt2' not in"):
        Architecture(family="gpt2", **dict(base, num_kv_heads=2))
    with pytest.raises(UnsupportedModelError, match="sliding_windows has 1 entries for 2"):
        Architecture(family="llama", **dict(base, num_kv_heads=2), sliding_windows=(4,))
    with pytest.raises(ValueError, match="stack must be one of"):
        build_config(Architecture(family="llama", **dict(base, num_kv_heads=2)), stack="x")


def test_what_hf_llama_cannot_express_is_refused():
    base = llama_config(vocab_size=32, dim=16, num_layers=1, num_heads=2, num_kv_heads=2,
                        ffn_dim=32)  # fmt: skip
    qk = base.clone()
    qk.decoder.transformer.layer.self_attention.qk_norm = RMSNorm.default_config()
    with pytest.raises(UnsupportedModelError, match="self_attention.qk_norm"):
        architecture_from_config(qk)
    capped = base.clone()
    capped.decoder.logits_soft_cap = 30.0
    with pytest.raises(UnsupportedModelError, match="logits_soft_cap"):
        architecture_from_config(capped)
    moe = replace_config(base, FeedForward, MixtureOfExperts.default_config().set(
        num_experts=2, num_experts_per_token=1, router_scores="sigmoid"))  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="softmax"):
        architecture_from_config(moe)
    # Partial RoPE with YaRN has no HF class (Phi-3 only takes LongRoPE).
    cfg = phi3_config(64, 32, 1, 4, 4, 48, rotary_fraction=0.5,
                      rope_scaling={"rope_type": "yarn", "factor": 2.0})  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="need HF Phi-3"):
        architecture_from_config(cfg)


def test_what_hf_gemma_cannot_express_is_refused():
    def refused(cfg, match):
        with pytest.raises(UnsupportedModelError, match=match):
            architecture_from_config(cfg)

    base = dict(vocab_size=64, dim=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=48,
                head_dim=8, sliding_window=4, stack="loop")  # fmt: skip
    cfg = gemma2_config(**base)
    cfg.decoder.transformer.layers[1].self_attention.rope.theta = 5e5
    refused(cfg, r"layers\[3\]\.self_attention\.rope: one RoPE per layer kind")
    cfg.decoder.transformer.layers[3].self_attention.rope.theta = 5e5  # all global layers
    refused(cfg, r"Gemma 2 has one RoPE theta")
    cfg = gemma2_config(**base)
    cfg.decoder.transformer.layers[2].self_attention.num_kv_heads = 4
    refused(cfg, r"layers\[2\]: differs from layer 0 in \['num_kv_heads'\]")
    cfg = gemma2_config(**base)
    cfg.decoder.transformer.layers[0].feed_forward.activation = ("silu", "linear")
    refused(cfg, r"layers\[0\]\.feed_forward: .*GeGLU")
    cfg = gemma2_config(**base)
    cfg.decoder.transformer.layers[3].post_norm = None
    refused(cfg, r"layers\[3\]: .*post_norm")
    refused(gemma3_config(**base, attn_logit_soft_cap=20.0),
            r"HF Gemma 3 has no attention soft cap")
