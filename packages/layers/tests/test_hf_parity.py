"""Logit parity with HF transformers `LlamaForCausalLM` / `MixtralForCausalLM` on tiny
random checkpoints.

Fixtures come from fixtures/make_hf_fixtures.py (run offline in a venv with torch). The
small converter below documents the layout mapping (see the README's HF Llama table); the
real converter lives in a leaf package.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxlearn.layers import llama_config, mixtral_config
from jaxlearn.module import functional

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
VARIANTS = ["llama_gqa_untied", "llama_gqa_tied_llama3", "llama_mqa_bias", "mixtral_e4_top2"]


def config_from_hf(hf: dict, **kw):
    rope = dict(hf["rope_parameters"])
    scaling = rope if rope.get("rope_type") == "llama3" else None
    if "num_local_experts" in hf:
        return mixtral_config(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf["num_key_value_heads"],
            ffn_dim=hf["intermediate_size"],
            num_experts=hf["num_local_experts"],
            num_experts_per_token=hf["num_experts_per_tok"],
            head_dim=hf["head_dim"],
            rope_theta=rope["rope_theta"],
            norm_eps=hf["rms_norm_eps"],
            tie_embeddings=hf["tie_word_embeddings"],
            **kw,
        )
    return llama_config(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        ffn_dim=hf["intermediate_size"],
        head_dim=hf["head_dim"],
        rope_theta=rope["rope_theta"],
        rope_scaling=scaling,
        norm_eps=hf["rms_norm_eps"],
        tie_embeddings=hf["tie_word_embeddings"],
        attention_bias=hf["attention_bias"],
        mlp_bias=hf["mlp_bias"],
        **kw,
    )


def params_from_hf(hf: dict, sd: dict, stack: str) -> dict:
    """HF Llama state dict (numpy) -> our nested params."""
    e, h, kv, d = (
        hf[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )

    def layer(i):
        pre = f"model.layers.{i}."
        w = lambda a: {"weight": a}  # noqa: E731  (a Linear child's params)
        attn = {
            "q_proj": w(sd[pre + "self_attn.q_proj.weight"].T.reshape(e, h, d)),
            "k_proj": w(sd[pre + "self_attn.k_proj.weight"].T.reshape(e, kv, d)),
            "v_proj": w(sd[pre + "self_attn.v_proj.weight"].T.reshape(e, kv, d)),
            "o_proj": w(sd[pre + "self_attn.o_proj.weight"].T.reshape(h, d, e)),
        }
        if hf["attention_bias"]:
            attn["q_proj"]["bias"] = sd[pre + "self_attn.q_proj.bias"].reshape(h, d)
            attn["k_proj"]["bias"] = sd[pre + "self_attn.k_proj.bias"].reshape(kv, d)
            attn["v_proj"]["bias"] = sd[pre + "self_attn.v_proj.bias"].reshape(kv, d)
            attn["o_proj"]["bias"] = sd[pre + "self_attn.o_proj.bias"]
        if "num_local_experts" in hf:  # Expert weights stay raw arrays of the MoE layer.
            f = hf["intermediate_size"]
            gate_up = sd[pre + "mlp.experts.gate_up_proj"]  # [experts, 2F, E]
            ffn = {
                "router": sd[pre + "mlp.gate.weight"].T,
                "wi_0": gate_up[:, :f].transpose(0, 2, 1),
                "wi_1": gate_up[:, f:].transpose(0, 2, 1),
                "wo": sd[pre + "mlp.experts.down_proj"].transpose(0, 2, 1),
            }
        else:
            ffn = {
                "wi_0": w(sd[pre + "mlp.gate_proj.weight"].T),
                "wi_1": w(sd[pre + "mlp.up_proj.weight"].T),
                "wo": w(sd[pre + "mlp.down_proj.weight"].T),
            }
        if hf["mlp_bias"]:
            ffn["wi_0"]["bias"] = sd[pre + "mlp.gate_proj.bias"]
            ffn["wi_1"]["bias"] = sd[pre + "mlp.up_proj.bias"]
            ffn["wo"]["bias"] = sd[pre + "mlp.down_proj.bias"]
        return {
            "attention_norm": {"scale": sd[pre + "input_layernorm.weight"]},
            "self_attention": attn,
            "ffn_norm": {"scale": sd[pre + "post_attention_layernorm.weight"]},
            "feed_forward": ffn,
        }

    layers = [layer(i) for i in range(hf["num_hidden_layers"])]
    if stack == "scan":
        transformer = {"layer": jax.tree.map(lambda *a: np.stack(a), *layers)}
    else:
        transformer = {f"layer{i}": p for i, p in enumerate(layers)}
    decoder = {
        "emb": {"weight": sd["model.embed_tokens.weight"]},
        "transformer": transformer,
        "output_norm": {"scale": sd["model.norm.weight"]},
    }
    if not hf["tie_word_embeddings"]:
        decoder["lm_head"] = {"weight": sd["lm_head.weight"].T}
    return jax.tree.map(jnp.asarray, {"decoder": decoder})


def load(name):
    hf = json.loads((FIXTURES / f"hf_{name}.json").read_text())
    sd = load_file(str(FIXTURES / f"hf_{name}.safetensors"))
    ref = np.load(FIXTURES / f"hf_{name}.npz", allow_pickle=False)
    return hf, sd, ref["input_ids"], ref["logits"]


CASES = [(v, "scan", "einsum") for v in VARIANTS] + [
    ("llama_gqa_untied", "loop", "dot_product_attention"),
    ("llama_gqa_tied_llama3", "loop", "einsum"),
    ("mixtral_e4_top2", "loop", "einsum"),
]


@pytest.mark.parametrize("variant,stack,impl", CASES)
def test_llama_logits_match_hf(variant, stack, impl):
    hf, sd, ids, ref = load(variant)
    model = config_from_hf(hf, stack=stack, attention_implementation=impl).instantiate()
    params = params_from_hf(hf, sd, stack)
    # The converted tree has exactly the structure and shapes of our own init.
    ours = jax.eval_shape(model.initialize_parameters_recursively, jax.random.key(0))
    assert jax.tree.map(lambda a: a.shape, ours) == jax.tree.map(lambda a: a.shape, params)
    logits, _ = jax.jit(
        lambda p, x: functional(model, None, p, ({"input_ids": x},), method="logits")
    )(params, jnp.asarray(ids))
    err = float(jnp.max(jnp.abs(logits - ref)))
    assert err <= 1e-4, err
