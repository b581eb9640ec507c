"""`Family`: everything one model family is, in one object: its config builder and the
reading back of a config, its HF `config.json` fields both ways, its GGUF metadata both
ways, its name-table rows and its checks. One module per family (`llama.py`, `qwen.py`,
`qwen3_moe.py`, `mixtral.py`, `phi3.py`, `gemma.py`) subclasses it; `registry.py` lists
them. The defaults here are those of a Llama-like decoder (`decoder.py`); a family
overrides what differs.

The GGUF hooks take duck-typed objects so that this package does no file I/O: `f` has
`path`, `get(key, default)` and `integer(key, default, low=, high=, required=)` (a
`jaxlearn.interop.gguf.GGUFFile`), `w` the `add_*` methods of `gguf.GGUFWriter`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from jaxlearn.families.arch import Architecture
from jaxlearn.families.checks import LIMITS, flag
from jaxlearn.families.decoder import bad, build_decoder, read_decoder, uniform_windows
from jaxlearn.families.errors import UnsupportedModelError
from jaxlearn.families.names import Row
from jaxlearn.layers import llama_config


class Family:
    """A model family (see the module docstring). Class attributes:

    name: `Architecture.family`, `CausalLM.Config.family` and HF `model_type`.
    hf_class: the HF class written to `architectures`; hf_names: further `model_type` /
    `architectures` values read as this family.
    gguf_architecture: the `general.architecture` written (None: no GGUF form);
    gguf_reads: the `general.architecture` values whose reading this family owns (the
    owner may resolve a file to another family: `gguf_family`).
    gguf_permutes_qk: llama.cpp permutes the q/k rows of this family for its interleaved
    RoPE. rows: the name table (`names.Row`s built from the shared row groups).
    qk_norm: per-head q/k RMSNorm. experts: every FFN (or all but `dense_layers`, when
    `dense_moe_layers`) is an MoE. partial_rotary: RoPE on a fraction of each head (HF
    `partial_rotary_factor`).
    recipe: the `jaxlearn.layers` recipe `build_config` starts from.
    hf_activation: the only activation HF's class has; hf_ffn_field: the config.json field
    of `ffn_dim`.
    """

    name: str = ""
    hf_class: str = ""
    hf_names: tuple[str, ...] = ()
    gguf_architecture: Optional[str] = None
    gguf_reads: tuple[str, ...] = ()
    gguf_permutes_qk: bool = False
    rows: tuple[Row, ...] = ()
    qk_norm: bool = False
    experts: bool = False
    dense_moe_layers: bool = False
    partial_rotary: bool = False
    recipe: Callable[..., Any] = staticmethod(llama_config)
    hf_activation: str = "silu"
    hf_ffn_field: str = "intermediate_size"
    rope_aliases: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    # ---- CausalLM config --------------------------------------------------------------------

    def build_config(self, arch: Architecture, **kwargs: Any) -> Any:
        """`CausalLM.Config` of `arch` (kwargs: stack, dtype, attention_implementation,
        moe_dropless_method, name), recording this family in it (`cfg.family`)."""
        cfg = build_decoder(arch, self.recipe, **kwargs)
        cfg.family = self.name
        return cfg

    def architecture_from_config(self, cfg: Any) -> Architecture:
        """The `Architecture` of a config of this family; `UnsupportedModelError` naming the
        config path of anything this family's HF class cannot express."""
        fields, windows = read_decoder(cfg)
        qk_norm = fields.pop("qk_norm")
        if qk_norm != self.qk_norm:
            has = "has" if self.qk_norm else "has no"
            raise bad("model.decoder.transformer.layers[0].self_attention.qk_norm",
                      f"family {self.name} {has} per-head q/k norms")  # fmt: skip
        self.check_config(fields, windows)
        return Architecture(family=self.name, **fields)

    def check_config(self, fields: dict[str, Any], windows: list[Optional[int]]) -> None:
        """Raises `UnsupportedModelError` for `Architecture` fields of a Llama-like config
        (`decoder.read_decoder`) that this family's HF class cannot express. Default:
        no partial RoPE or LongRoPE (Phi-3's), no experts unless `experts`."""
        longrope = (fields["rope_scaling"] or {}).get("rope_type") == "longrope"
        if not self.partial_rotary and (fields["rotary_fraction"] != 1.0 or longrope):
            raise self.refuse("partial RoPE / LongRoPE need HF Phi-3")
        if bool(fields["num_experts"]) != self.experts:
            raise self.refuse("needs experts" if self.experts else "has no experts")
        if fields.get("dense_layers") and not self.dense_moe_layers:
            raise self.refuse("has no dense layers in an MoE model (Qwen3-MoE has)")

    def refuse(self, why: str) -> UnsupportedModelError:
        """`UnsupportedModelError` of a config of this family that HF cannot hold."""
        return UnsupportedModelError(f"cannot export: {self.hf_class} (model.family = "
                                     f"{self.name!r}) {why}")  # fmt: skip

    def check_no_biases(self, fields: dict[str, Any], *keys: str) -> None:
        """Refuses the biases `keys` (default: attention and MLP biases)."""
        for key in keys or ("qkv_bias", "output_bias", "mlp_bias"):
            if fields[key]:
                raise self.refuse(f"has no {key}")

    def check_one_window(self, windows: list[Optional[int]]) -> None:
        if not uniform_windows(windows):
            raise self.refuse("takes one sliding window for every layer")

    # ---- HF config.json ---------------------------------------------------------------------

    def hf_text_config(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """The config.json dict of the text model (a multimodal config holds one)."""
        return hf

    def hf_act(self, hf: dict[str, Any]) -> Any:
        return hf.get("hidden_act")

    def hf_fields(self, hf: dict[str, Any], where: str, layers: int) -> dict[str, Any]:
        """This family's `Architecture` fields of a config.json dict, checked: sliding
        windows, biases, experts and anything else only it has."""
        raise NotImplementedError(f"{self.name}: hf_fields")

    def hf_dict(self, arch: Architecture, out: dict[str, Any]) -> None:
        """Adds this family's fields to the config.json dict `out` of `arch`."""

    # ---- GGUF metadata ----------------------------------------------------------------------

    def gguf_family(self, experts: int, window: Optional[int]) -> "Family":
        """The family of a `gguf_reads` file with `experts` experts and sliding `window`."""
        return self

    def gguf_fields(self, f: Any, arch_name: str, sizes: dict[str, Any]) -> dict[str, Any]:
        """`family` and the fields only some families have (sliding windows, Gemma's) of
        GGUF file `f`, whose `general.architecture` is `arch_name` (one of `gguf_reads`);
        `sizes`: the common sizes already read (num_layers, num_experts, ...)."""
        key = f"{arch_name}.attention.sliding_window"
        window = f.integer(key, high=LIMITS["window"])
        family = self.gguf_family(sizes["num_experts"], window)
        return dict(family=family.name,
                    sliding_windows=(window,) * sizes["num_layers"] if window else ())  # fmt: skip

    def gguf_name(self, arch: Architecture) -> str:
        """`general.architecture` of a GGUF export of `arch` (raises what llama.cpp's
        architecture cannot hold)."""
        if self.gguf_architecture is None:
            raise UnsupportedModelError(f"cannot export to GGUF: {self.name} has no GGUF form")
        uniform, _ = arch.uniform_sliding_window()
        if not uniform:
            raise UnsupportedModelError(
                f"cannot export to GGUF: layers have different sliding windows "
                f"{list(arch.sliding_windows)}; llama.cpp's {arch.family} takes one window"
            )
        return self.gguf_architecture

    def write_gguf_keys(self, w: Any, arch: Architecture) -> None:
        """The `{arch}.*` keys of this family besides the common sizes and RoPE keys."""
        _, window = arch.uniform_sliding_window()
        if window is not None:
            w.add_sliding_window(int(window))
        if arch.is_moe:
            w.add_expert_count(arch.num_experts)
            w.add_expert_used_count(arch.num_experts_per_token)


def read_flag(hf: dict[str, Any], where: str, field: str) -> bool:
    return flag(hf.get(field), where, field)
