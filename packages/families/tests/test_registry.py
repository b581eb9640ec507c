"""The registry holds every family module, and each family round-trips what it owns:
its config builder (`build_config` -> `architecture_from_config`), its HF config.json
fields and its GGUF metadata keys (written with a recording stand-in of
`gguf.GGUFWriter`, read back by the family that owns the file's
`general.architecture`)."""

import importlib
import pathlib

import pytest

import jaxlearn.families as families_package
from jaxlearn.families import (
    Architecture,
    Family,
    UnsupportedModelError,
    architecture_from_config,
    architecture_from_hf,
    build_config,
    hf_config_dict,
)
from jaxlearn.families.registry import FAMILIES, family_of_gguf, family_of_hf
from jaxlearn.layers import llama_config

BASE = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            ffn_dim=48, norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128)  # fmt: skip
# One architecture of each family that HF and llama.cpp can both hold.
SAMPLES = {
    "llama": dict(qkv_bias=True, output_bias=True, mlp_bias=True),
    "mistral": dict(sliding_windows=(6, 6)),
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(head_dim=16),
    "mixtral": dict(num_experts=4, sliding_windows=(5, 5)),
    "qwen3_moe": dict(num_experts=4, num_experts_per_token=3, normalize_top_k=False),
    "phi3": dict(rotary_fraction=0.5, sliding_windows=(6, 6)),
    "gemma2": dict(tie_embeddings=True, sliding_windows=(4, None), query_pre_attn_scalar=8.0,
                   attn_logit_soft_cap=50.0, final_logit_soft_cap=30.0),
    "gemma3_text": dict(num_layers=6, sliding_windows=(4,) * 5 + (None,), query_pre_attn_scalar=8.0,
                        local_rope_theta=1e4, rope_theta=1e6),
}  # fmt: skip


def sample(name):
    return Architecture(family=name, **dict(BASE, **SAMPLES[name]))


def test_the_registry_holds_every_family_module_once():
    directory = pathlib.Path(families_package.__file__).parent
    found = set()
    for path in sorted(directory.glob("*.py")):
        module = importlib.import_module(f"jaxlearn.families.{path.stem}")
        for value in vars(module).values():
            if isinstance(value, Family) and type(value).__module__ == module.__name__:
                found.add(value.name)
                assert FAMILIES[value.name] is value, value
    assert found == set(FAMILIES) == set(SAMPLES)
    classes = [f.hf_class for f in FAMILIES.values()]
    assert len(set(classes)) == len(classes)
    for fam in FAMILIES.values():
        assert fam.rows and fam.hf_class.endswith("ForCausalLM")
        assert family_of_hf({"model_type": fam.name}, "c") is fam
        assert family_of_hf({"architectures": [fam.hf_class]}, "c") is fam
        for name in fam.gguf_reads:
            assert family_of_gguf(name, "f") is fam
    assert family_of_hf({"model_type": "gemma3"}, "c") is FAMILIES["gemma3_text"]
    with pytest.raises(UnsupportedModelError, match="c: model_type 'gpt2'"):
        family_of_hf({"model_type": "gpt2", "architectures": ["LlamaForCausalLM"]}, "c")
    with pytest.raises(UnsupportedModelError, match="f: general.architecture 'bert'"):
        family_of_gguf("bert", "f")


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_family_round_trips_its_config_and_its_hf_config_json(name):
    arch = sample(name)
    cfg = build_config(arch, stack="loop")
    assert cfg.family == name
    back = architecture_from_config(cfg)
    back.max_position_embeddings = arch.max_position_embeddings
    assert back == arch
    hf = hf_config_dict(arch)
    assert (hf["model_type"], hf["architectures"]) == (name, [FAMILIES[name].hf_class])
    assert architecture_from_hf(hf, where="config.json") == arch


class Writer:
    """Records what `Family.write_gguf_keys` writes, under gguf-py's key names."""

    KEYS = {
        "add_sliding_window": "attention.sliding_window",
        "add_expert_count": "expert_count",
        "add_expert_used_count": "expert_used_count",
        "add_expert_feed_forward_length": "expert_feed_forward_length",
        "add_expert_weights_norm": "expert_weights_norm",
        "add_attn_logit_softcapping": "attn_logit_softcapping",
        "add_final_logit_softcapping": "final_logit_softcapping",
    }

    def __init__(self, arch_name):
        self.arch_name, self.metadata = arch_name, {}

    def __getattr__(self, method):
        key = f"{self.arch_name}.{self.KEYS[method]}"
        return lambda value: self.metadata.__setitem__(key, value)


class File:
    """The metadata reads of `jaxlearn.interop.gguf.GGUFFile` over a dict."""

    path = "x.gguf"

    def __init__(self, metadata):
        self.metadata = metadata

    def get(self, key, default=None):
        return self.metadata.get(key, default)

    def integer(self, key, default=None, *, low=1, high, required=False):
        if required and key not in self.metadata:
            raise UnsupportedModelError(f"{key} is missing")
        value = self.metadata.get(key, default)
        assert value is None or low <= value <= high
        return value


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_family_round_trips_its_gguf_metadata(name):
    arch = sample(name)
    fam = FAMILIES[name]
    arch_name = fam.gguf_name(arch)
    w = Writer(arch_name)
    fam.write_gguf_keys(w, arch)
    owner = family_of_gguf(arch_name, "x.gguf")
    experts = w.metadata.get(f"{arch_name}.expert_count", 0)
    sizes = dict(num_layers=arch.num_layers, num_experts=experts, dim=arch.dim,
                 num_heads=arch.num_heads, head_dim=arch.head_dim,
                 rotary_fraction=arch.rotary_fraction)  # fmt: skip
    fields = owner.gguf_fields(File(w.metadata), arch_name, sizes)
    assert fields.pop("family") == name
    assert fields == {k: getattr(arch, k) for k in fields}
    if arch.is_moe:
        assert experts == arch.num_experts
        assert w.metadata[f"{arch_name}.expert_used_count"] == arch.num_experts_per_token


def test_a_config_without_a_family_is_refused_naming_the_field():
    cfg = llama_config(64, 32, 1, 4, 2, 48, family=None)
    with pytest.raises(UnsupportedModelError, match=r"^cannot export model.family = None: .*"
                                                    r"built by hand.*one of \["):  # fmt: skip
        architecture_from_config(cfg)
    cfg.family = "gpt2"
    with pytest.raises(UnsupportedModelError, match="model.family = 'gpt2': not one of"):
        architecture_from_config(cfg)


def test_the_recorded_family_decides_and_checks_what_it_can_hold():
    """A Llama config with a window is no Llama (HF Llama has none) but is a Mistral; the
    same weights as Qwen2 need q/k/v biases."""
    cfg = llama_config(64, 32, 2, 4, 2, 48, head_dim=8)
    cfg.decoder.transformer.layer.self_attention.sliding_window = 6
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM .* has no sliding"):
        architecture_from_config(cfg)
    cfg.family = "mistral"
    assert architecture_from_config(cfg).sliding_windows == (6, 6)
    cfg.family = "qwen2"
    with pytest.raises(UnsupportedModelError, match="has biases on q/k/v and none on o"):
        architecture_from_config(cfg)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_fused_projections_compute_every_familys_logits(name):
    """The serving engine fuses q/k/v and gate/up (`layers.fuse_projections`) whenever it
    packs bf16 weights: the fused model gives the family's logits (f32, the same params)."""
    import jax
    import numpy as np

    from jaxlearn.layers import fuse_projections

    cfg = build_config(sample(name), stack="loop").set(name="model")
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.key(0))
    fused_cfg, fused = fuse_projections(cfg, params)
    ids = jax.random.randint(jax.random.key(1), (2, 11), 0, BASE["vocab_size"])

    def logits(c, p):
        from jaxlearn.module import functional

        out, _ = functional(c.instantiate(), None, p, ({"input_ids": ids},), method="logits",
                            is_training=False)
        return np.asarray(out)

    np.testing.assert_allclose(logits(fused_cfg, fused), logits(cfg, params), rtol=1e-5,
                               atol=1e-5)
