"""LoRA adapters alone, in the directory layout of Hugging Face PEFT.

    export_peft("adapter/", lora_cfg, params, base_model_name_or_path="SmolLM2-135M")
    adapter = read_peft("adapter/", base_cfg)   # PeftAdapter: rank, alpha, model_config, params
    is_peft_adapter("adapter/")                 # True: adapter_config.json is there

A PEFT LoRA directory holds `adapter_config.json` (peft_type "LORA", r, lora_alpha,
target_modules, ...) and `adapter_model.safetensors`, one pair of tensors per adapted HF
`nn.Linear` (weight [out, in]):

    base_model.model.{module}.lora_A.weight   [r, in]
    base_model.model.{module}.lora_B.weight   [out, r]
    y = x W^T + (lora_alpha / r) * x A^T B^T       (lora_alpha / sqrt(r) with use_rslora)

jaxlearn's `LoraLinear` holds `adapter.lora_a [*in, r]` and `adapter.lora_b [r, *out]`
(`jaxlearn.layers.lora`), stacked [layers, ...] under a scanned stack. The HF module of a
jaxlearn projection is the one of its weight in the family's name table
(`jaxlearn.families.names`, through `convert.plan`, as `export_hf` writes it); the
in/out axes are flattened in the same order as the weight's. A jaxlearn-side fused
projection (`qkv_proj`, `wi_fused`: `composition.fuse_projections`) is written as its
parts (lora_a repeated, lora_b split) and read back only when the parts share lora_a.
HF-side fused tensors (Phi-3's `qkv_proj` / `gate_up_proj`) and expert weights are refused.

Import is the reverse for a base model config: the adapter's rank, alpha, dropout and
targets make it LoRA (`layers.use_lora`, over the jaxlearn config names of the adapted
projections: q_proj, k_proj, v_proj, o_proj, wi (gate and up together), wo, lm_head), and
every projection that `use_lora` then adapts must have its pair of tensors. Only
safetensors are read (an `adapter_model.bin` is never unpickled). PEFT options that change
the forward pass in ways jaxlearn does not compute (use_dora, modules_to_save, bias other
than "none", rank_pattern / alpha_pattern, layers_to_transform, fan_in_fan_out, lora_bias,
target_parameters) are refused; use_rslora is read as the equivalent alpha
(lora_alpha * sqrt(r)). Every error is one line naming the file (and tensor).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
from typing import Any, Optional, Union

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxlearn.config import REQUIRED, leaves, replace_config
from jaxlearn.families.arch import architecture_from_config
from jaxlearn.families.names import FUSIONS, dims, key_of, shape_of
from jaxlearn.families.tree import flatten, group_size, layer_layouts, stack_kind
from jaxlearn.interop.atomic import prepare_output, write_atomically
from jaxlearn.interop.convert import Use, file_shape, plan
from jaxlearn.interop.errors import (
    InteropError,
    MalformedFileError,
    ParameterMismatchError,
    UnsupportedModelError,
)
from jaxlearn.interop.hf import PICKLE_WEIGHTS, read_json

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_TENSOR = re.compile(re.escape(PREFIX) + r"(.+)\.lora_([AB])\.weight")
_ADAPTER = ".adapter.lora_"
# adapter_config.json fields that change what the adapter computes, and the value under
# which jaxlearn's LoRA forward is the same.
_REFUSED: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None), "modules_to_save": (None, []), "bias": ("none",),
    "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "layers_to_transform": (None, []),
    "fan_in_fan_out": (False, None), "lora_bias": (False, None),
    "target_parameters": (None, []),
}  # fmt: skip

PathLike = Union[str, pathlib.Path]


@dataclasses.dataclass
class PeftAdapter:
    """A PEFT LoRA adapter read for a base model config.

    rank, alpha, dropout: the `LoraLinear` fields (alpha such that alpha / rank is PEFT's
    scaling). targets: the `use_lora` regex over config paths; target_paths: the config
    paths it made LoRA. model_config: the base config made LoRA with them. params: the
    adapter params alone (numpy float32, the jaxlearn layout of `model_config`: the
    `adapter` subtrees, stacked like the model's layers). base_model_name_or_path: as
    the adapter config names it (None: not given)."""

    rank: int
    alpha: float
    dropout: float
    targets: str
    target_paths: tuple[str, ...]
    model_config: Any
    params: dict[str, Any]
    base_model_name_or_path: Optional[str]
    source: str


def is_peft_adapter(path: PathLike) -> bool:
    """Whether `path` is a directory holding an `adapter_config.json`."""
    return (pathlib.Path(path) / CONFIG_FILE).is_file()


def lora_layers(config: Any) -> dict[str, tuple[int, float, float]]:
    """{config path of each `LoraLinear` config: (rank, alpha, dropout)} of a model config."""
    fields: dict[str, dict[str, Any]] = {}
    for path, value in leaves(config, literal_sequences=True):
        node, _, name = path.rpartition(".")
        if name in ("lora_rank", "lora_alpha", "lora_dropout"):
            fields.setdefault(node, {})[name] = value
    return {node: (f["lora_rank"], float(f["lora_alpha"]), float(f["lora_dropout"]))
            for node, f in fields.items() if "lora_rank" in f}  # fmt: skip


def plain_config(config: Any) -> Any:
    """`config` with every `LoraLinear` config made a plain `Linear` one again."""
    from jaxlearn.layers import Linear
    from jaxlearn.layers.lora import LoraLinear

    return replace_config(config, lambda path, c: "klass" in c and c.klass is LoraLinear,
                          lambda old, path: Linear.default_config(), allow_no_match=True)


# ---- where each adapter goes --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One adapter param at one layer: the canonical module key (`self_attention.q_proj`,
    top level `lm_head`), the model param path holding it and its index there (a scanned
    stack's leading axis; None: the whole array)."""

    layer: Optional[int]
    key: str
    path: str
    index: Optional[int]


def _instantiate(config: Any) -> Any:
    return (config.clone(name="model") if config.name is REQUIRED else config).instantiate()


def _slots(model: Any, path: str) -> list[_Slot]:
    """Where the adapter param at `path` (e.g. `decoder.transformer.layer.self_attention.
    q_proj.adapter.lora_a`) sits, per layer of the model."""
    key = path[: path.index(_ADAPTER)]
    if not key.startswith("decoder.transformer."):
        return [_Slot(None, key.removeprefix("decoder."), path, None)]
    rest = key.removeprefix("decoder.transformer.")
    n = model.decoder.transformer.config.num_layers
    if stack_kind(model) == "loop":
        head, _, key = rest.partition(".")
        return [_Slot(int(head.removeprefix("layer")), key, path, None)]
    key = rest.removeprefix("layer.")
    p = group_size(model)
    if p is None:
        return [_Slot(i, key, path, i) for i in range(n)]
    head, _, key = key.partition(".")
    k = int(head.removeprefix("layer"))
    return [_Slot(j * p + k, key, path, j) for j in range(n)]


def _adapter_specs(model: Any) -> dict[str, Any]:
    return {k: v for k, v in flatten(model.create_parameter_specs_recursively()).items()
            if _ADAPTER in k}  # fmt: skip


class _Names:
    """The HF modules of a model's projections (the family's name table), per layer."""

    def __init__(self, model: Any, config: Any, where: str):
        self.arch = architecture_from_config(plain_config(config))
        self.d = dims(self.arch)
        self.uses: dict[tuple[Optional[int], str], Use] = {
            (u.layer, u.row.key): u for u in plan(self.arch, "hf")}  # fmt: skip
        self.layouts = layer_layouts(model)
        self.where = where

    def parts(self, layer: Optional[int], key: str) -> tuple[list[tuple[Use, int]], int]:
        """([(HF `Use`, its size on the fused axis)], axis) of module `key` at `layer`:
        one part (axis 0) unless `key` is a jaxlearn-side fusion."""
        weight = key + ".weight"
        if (layer, weight) in self.uses:
            return [(self.linear(self.uses[layer, weight]), 0)], 0
        for f in FUSIONS:
            if key_of(f.path) == weight:
                uses = [self.linear(self.uses[layer, key_of(p)]) for p in f.parts]
                return [(u, shape_of(u.row.shape, self.d)[f.axis]) for u in uses], f.axis
        raise UnsupportedModelError(f"{self.where}: {key} (layer {layer}) has no HF tensor in "
                                    f"the {self.arch.family} name table")

    def linear(self, use: Use) -> Use:
        name = use.name
        if (not name.transpose or name.part is not None or name.per_expert
                or not name.template.endswith(".weight")):
            raise UnsupportedModelError(
                f"{self.where}: {use.row.key} is stored in HF tensor {use.files[0]}, which "
                f"PEFT cannot adapt as one nn.Linear of its own ({self.arch.family})")
        return use

    def module(self, use: Use) -> str:
        return use.files[0].removesuffix(".weight")

    def fused_key(self, layer: Optional[int], weight: str) -> str:
        """The module key of `weight` in this model: its fusion's where the layer fuses."""
        if layer is not None:
            for f in FUSIONS:
                if f.when in self.layouts[layer] and weight in map(key_of, f.parts):
                    return key_of(f.path).removesuffix(".weight")
        return weight.removesuffix(".weight")


# ---- export ---------------------------------------------------------------------------------


def export_peft(
    path: PathLike,
    config: Any,
    params: dict[str, Any],
    *,
    base_model_name_or_path: Optional[str] = None,
    dtype: str = "float32",
    overwrite: bool = False,
) -> pathlib.Path:
    """Writes the LoRA adapters of a jaxlearn model (a `use_lora` config and its params:
    the whole model's or the adapters alone) as a PEFT adapter directory:
    adapter_config.json (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
    lora_dropout, target_modules as HF module names, bias "none", base_model_name_or_path
    when given) and adapter_model.safetensors (`dtype`: float32, bfloat16 or float16).

    The directory appears whole (`jaxlearn.interop.atomic`); an existing non-empty one is
    refused unless `overwrite`. Raises InteropError when the config has no LoRA layers,
    UnsupportedModelError for LoRA layers with different rank/alpha/dropout or on
    projections PEFT cannot address, ParameterMismatchError for adapter params that do
    not match the config."""
    out = pathlib.Path(path)
    prepare_output(out, kind="dir", overwrite=overwrite)
    tensors, adapter_config = peft_state(config, params, where=f"PEFT export {out}",
                                         base_model_name_or_path=base_model_name_or_path)
    tensors = {k: _cast(v, dtype) for k, v in tensors.items()}
    with write_atomically(out, kind="dir", overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def lora_settings(config: Any, where: str) -> tuple[int, float, float]:
    """(rank, alpha, dropout) shared by every LoRA layer of a model config; InteropError
    when it has none, UnsupportedModelError when they differ (PEFT's config holds one)."""
    layers = lora_layers(config)
    if not layers:
        raise InteropError(f"{where}: the model has no LoRA adapters (no LoraLinear layers)")
    settings = set(layers.values())
    if len(settings) > 1:
        raise UnsupportedModelError(f"{where}: LoRA layers with different (rank, alpha, "
                                    f"dropout) {sorted(settings)}; PEFT's config holds one")
    return settings.pop()


def peft_state(
    config: Any, params: dict[str, Any], *, where: str,
    base_model_name_or_path: Optional[str] = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """({PEFT tensor name: float32 array}, adapter_config.json dict) of a LoRA model's
    adapters, without writing (see `export_peft`)."""
    rank, alpha, dropout = lora_settings(config, where)
    model = _instantiate(config)
    names = _Names(model, config, where)
    arrays = _adapter_arrays(model, params, where)
    tensors: dict[str, np.ndarray] = {}
    for path_a, array_a in arrays.items():
        if not path_a.endswith("lora_a"):
            continue
        array_b = arrays[path_a.removesuffix("lora_a") + "lora_b"]
        for slot in _slots(model, path_a):
            a = array_a if slot.index is None else array_a[slot.index]
            b = array_b if slot.index is None else array_b[slot.index]
            parts, axis = names.parts(slot.layer, slot.key)
            pieces = np.split(b, np.cumsum([s for _, s in parts])[:-1], axis=axis) \
                if len(parts) > 1 else [b]  # fmt: skip
            for (use, _), piece in zip(parts, pieces):
                out_n, in_n = file_shape(use, names.d)
                stem = PREFIX + names.module(use)
                tensors[stem + ".lora_A.weight"] = np.ascontiguousarray(a.reshape(in_n, rank).T)
                tensors[stem + ".lora_B.weight"] = np.ascontiguousarray(
                    piece.reshape(rank, out_n).T)
    modules = sorted({_stem(n) for n in tensors})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout, "target_modules": _target_modules(modules, names),
        "bias": "none", "base_model_name_or_path": base_model_name_or_path,
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {},
    }  # fmt: skip
    return tensors, adapter_config


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    import jax.numpy as jnp  # noqa: F401  (numpy reads bfloat16 through ml_dtypes)

    return np.ascontiguousarray(np.asarray(x, np.float32).astype(np.dtype(dtype)))


def _stem(tensor: str) -> str:
    m = _TENSOR.fullmatch(tensor)
    assert m is not None
    return m.group(1)


def _target_modules(modules: list[str], names: _Names) -> Union[list[str], str]:
    """PEFT's target_modules: the last names (q_proj, ...) when each is adapted wherever the
    model has it, else a regex matching exactly `modules`."""
    everywhere = {names.module(u) for u in names.uses.values()}
    short = sorted({m.rpartition(".")[2] for m in modules})
    if {m for m in everywhere if m.rpartition(".")[2] in short} == set(modules):
        return short
    return "(" + "|".join(re.escape(m) for m in modules) + ")"


def _adapter_arrays(model: Any, params: dict[str, Any], where: str) -> dict[str, np.ndarray]:
    """{path: float32 array} of every adapter param, checked against the model's specs."""
    specs = _adapter_specs(model)
    got = {k: v for k, v in flatten(params).items() if _ADAPTER in k}
    missing = sorted(set(specs) - set(got))
    unexpected = sorted(set(got) - set(specs))
    mismatched = [f"{k}: got {tuple(np.shape(got[k]))}, expected {tuple(s.shape)}"
                  for k, s in specs.items() if k in got and np.shape(got[k]) != tuple(s.shape)]
    if missing or unexpected or mismatched:
        raise ParameterMismatchError(where, missing=missing, unexpected=unexpected,
                                     mismatched=mismatched)
    return {k: np.asarray(got[k], np.float32) for k in specs}


# ---- import ---------------------------------------------------------------------------------


def read_peft_config(path: PathLike) -> dict[str, Any]:
    """adapter_config.json of a PEFT directory, checked: a LoRA adapter whose options
    jaxlearn computes (see the module doc); one-line InteropError naming the file."""
    file = pathlib.Path(path) / CONFIG_FILE
    if not pathlib.Path(path).is_dir():
        raise InteropError(f"{path}: not a directory (a PEFT adapter is a directory with "
                           f"{CONFIG_FILE})")
    cfg = read_json(file)
    if not isinstance(cfg, dict):
        raise MalformedFileError(f"{file}: not a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise UnsupportedModelError(f"{file}: peft_type {cfg.get('peft_type')!r}; only LORA "
                                    "adapters are read")
    if cfg.get("task_type") not in (None, "CAUSAL_LM"):
        raise UnsupportedModelError(f"{file}: task_type {cfg['task_type']!r}; only CAUSAL_LM "
                                    "adapters are read")
    for field, fine in _REFUSED.items():
        if field in cfg and cfg[field] not in fine:
            raise UnsupportedModelError(
                f"{file}: {field} = {json.dumps(cfg[field])} is not supported (jaxlearn's "
                f"LoRA computes {field} = {json.dumps(fine[0])})")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise MalformedFileError(f"{file}: r = {r!r}, expected an int >= 1")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise MalformedFileError(f"{file}: lora_alpha = {alpha!r}, expected a number > 0")
    dropout = cfg.get("lora_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise MalformedFileError(f"{file}: lora_dropout = {dropout!r}, expected [0, 1)")
    targets = cfg.get("target_modules")
    if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                         and all(isinstance(t, str) for t in targets))):
        raise MalformedFileError(f"{file}: target_modules = {json.dumps(targets)}, expected "
                                 "a list of module names or a regex")
    return cfg


class Tensors:
    """PEFT tensors by name: `adapter_model.safetensors` (`open_weights`) or a dict."""

    def __init__(self, where: str, tensors: Optional[dict[str, np.ndarray]] = None,
                 handle: Any = None):
        self.where, self._dict, self._handle = where, tensors, handle

    def names(self) -> list[str]:
        return list(self._dict if self._dict is not None else self._handle.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        if self._dict is not None:
            return tuple(self._dict[name].shape)
        return tuple(self._guard(name, lambda: self._handle.get_slice(name).get_shape()))

    def read(self, name: str) -> np.ndarray:
        if self._dict is not None:
            return np.asarray(self._dict[name], np.float32)
        return np.asarray(self._guard(name, lambda: self._handle.get_tensor(name)), np.float32)

    def _guard(self, name: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:  # safetensors / ml_dtypes errors on a damaged file
            what = " ".join(str(e).split())
            raise MalformedFileError(f"{self.where}: tensor {name}: {what}") from None


def open_weights(directory: pathlib.Path) -> Tensors:
    """The tensors of `directory`'s adapter_model.safetensors (never a pickle)."""
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        pickles = sorted({p.name for pat in PICKLE_WEIGHTS for p in directory.glob(pat)})
        if pickles:
            raise InteropError(f"{directory}: holds only PyTorch pickle weights "
                               f"({', '.join(pickles[:3])}); only {WEIGHTS_FILE} is read "
                               "(pickles are never unpickled)")
        raise InteropError(f"{file}: not found")
    try:
        return Tensors(str(file), handle=safe_open(str(file), framework="numpy"))
    except Exception as e:  # safetensors raises its own error types
        what = " ".join(str(e).split())
        raise MalformedFileError(f"{file}: not a readable safetensors file ({what})") from None


def _targeted(module: str, targets: Union[str, list[str]]) -> bool:
    """PEFT's matching of target_modules against a module name."""
    if isinstance(targets, str):
        if targets == "all-linear":
            return not module.endswith("lm_head")
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def read_peft(path: PathLike, base_config: Any) -> PeftAdapter:
    """The PEFT LoRA adapter directory `path` for the model config `base_config` (LoRA
    layers it already has are replaced): the config made LoRA with the adapter's rank,
    alpha, dropout and targets, and the adapter params in its layout (see `PeftAdapter`
    and the module doc). Raises a one-line InteropError naming the file (and tensor) for
    a malformed or unsupported adapter, an unknown target module, a tensor of the wrong
    shape or a missing one."""
    directory = pathlib.Path(path)
    cfg = read_peft_config(directory)
    return adapter_from_tensors(open_weights(directory), cfg, base_config,
                                config_file=str(directory / CONFIG_FILE), source=str(directory))


def adapter_from_tensors(tensors: Tensors, cfg: dict[str, Any], base_config: Any, *,
                         config_file: str, source: str) -> PeftAdapter:
    """`read_peft` of PEFT tensors and a checked adapter config (`read_peft_config`)."""
    file = tensors.where
    rank = cfg["r"]
    alpha = float(cfg["lora_alpha"]) * (math.sqrt(rank) if cfg.get("use_rslora") else 1.0)
    plain = plain_config(base_config)
    names = _Names(_instantiate(plain), plain, str(file))
    by_module = {names.module(u): u for u in names.uses.values()
                 if u.row.key.endswith(".weight") and u.name.transpose}
    pairs: dict[str, dict[str, str]] = {}
    for tensor in tensors.names():
        m = _TENSOR.fullmatch(tensor)
        if m is None:
            raise UnsupportedModelError(f"{file}: tensor {tensor} is not a LoRA A/B weight "
                                        f"({PREFIX}<module>.lora_A.weight / lora_B.weight)")
        module = m.group(1)
        if module not in by_module:
            raise UnsupportedModelError(f"{file}: tensor {tensor}: no projection {module} in "
                                        f"the {names.arch.family} model "
                                        f"({names.arch.num_layers} layers)")
        if not _targeted(module, cfg["target_modules"]):
            raise MalformedFileError(f"{file}: tensor {tensor}: {module} is not in "
                                     f"target_modules {json.dumps(cfg['target_modules'])}")
        names.linear(by_module[module])  # refuses HF-fused and expert tensors
        pairs.setdefault(module, {})[m.group(2)] = tensor
    if not pairs:
        raise MalformedFileError(f"{file}: holds no LoRA tensors")
    if isinstance(cfg["target_modules"], list):
        unknown = sorted(t for t in cfg["target_modules"]
                         if not any(_targeted(m, [t]) for m in by_module))
        if unknown:
            known = sorted({m.rpartition(".")[2] for m in by_module})
            raise UnsupportedModelError(f"{config_file}: target_modules {unknown} "
                                        f"are no projections of the {names.arch.family} "
                                        f"model (known: {known})")
    keys = {names.fused_key(by_module[m].layer, by_module[m].row.key) for m in pairs}
    config_names = sorted({re.sub(r"_\d+$", "", k.rpartition(".")[2]) for k in keys})
    targets = rf".*\.({'|'.join(config_names)})"
    from jaxlearn.layers import use_lora

    try:
        lora_cfg = use_lora(plain, rank=rank, alpha=alpha, targets=targets,
                            dropout=float(cfg.get("lora_dropout", 0.0)))
    except ValueError as e:
        raise UnsupportedModelError(f"{file}: {' '.join(str(e).split())}") from None
    model = _instantiate(lora_cfg)
    names = _Names(model, lora_cfg, str(file))
    params: dict[str, Any] = {}
    specs = _adapter_specs(model)
    for spec_path, spec in specs.items():
        if not spec_path.endswith("lora_a"):
            continue
        path_b = spec_path.removesuffix("lora_a") + "lora_b"
        a_out = np.zeros(spec.shape, np.float32)
        b_out = np.zeros(specs[path_b].shape, np.float32)
        for slot in _slots(model, spec_path):
            a_shape = a_out.shape if slot.index is None else a_out.shape[1:]
            b_shape = b_out.shape if slot.index is None else b_out.shape[1:]
            a, b = _read_slot(tensors, pairs, names, slot, rank, a_shape, b_shape)
            if slot.index is None:
                a_out[...], b_out[...] = a, b
            else:
                a_out[slot.index], b_out[slot.index] = a, b
        _put(params, spec_path, a_out)
        _put(params, path_b, b_out)
    unused = sorted(set(pairs) - _used_modules(model, specs, names))
    if unused:
        raise UnsupportedModelError(f"{file}: tensor {pairs[unused[0]].popitem()[1]}: "
                                    f"{unused[0]} is not adapted by use_lora({targets!r})")
    return PeftAdapter(rank=rank, alpha=alpha, dropout=float(cfg.get("lora_dropout", 0.0)),
                       targets=targets, target_paths=tuple(lora_layers(lora_cfg)),
                       model_config=lora_cfg, params=params,
                       base_model_name_or_path=cfg.get("base_model_name_or_path"),
                       source=source)


def _used_modules(model: Any, specs: dict[str, Any], names: _Names) -> set[str]:
    out: set[str] = set()
    for path in specs:
        for slot in _slots(model, path):
            out.update(names.module(u) for u, _ in names.parts(slot.layer, slot.key)[0])
    return out


def _read_slot(tensors: Tensors, pairs: dict[str, dict[str, str]],
               names: _Names, slot: _Slot, rank: int, a_shape: tuple[int, ...],
               b_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(lora_a, lora_b) of one slot in the jaxlearn layout, read from the file."""
    file = tensors.where
    parts, axis = names.parts(slot.layer, slot.key)
    a_got: Optional[np.ndarray] = None
    pieces = []
    for use, size in parts:
        out_n, in_n = file_shape(use, names.d)
        module = names.module(use)
        got = {}
        for which, want in (("A", (rank, in_n)), ("B", (out_n, rank))):
            tensor = pairs.get(module, {}).get(which) or f"{PREFIX}{module}.lora_{which}.weight"
            if which not in pairs.get(module, {}):
                raise MalformedFileError(f"{file}: no tensor {tensor} {want} (use_lora adapts "
                                         f"{slot.key} in every layer)")
            shape = tensors.shape(tensor)
            if shape != want:
                raise MalformedFileError(f"{file}: tensor {tensor}: shape {shape}, expected "
                                         f"{want} (r={rank})")
            got[which] = tensors.read(tensor)
        a = got["A"].T.reshape(a_shape)
        if a_got is not None and not np.array_equal(a, a_got):
            raise UnsupportedModelError(
                f"{file}: {module}: lora_A differs from the other parts of the fused "
                f"{slot.key}; load the adapter onto a model without fused projections")
        a_got = a
        piece_shape = list(b_shape)
        if len(parts) > 1:
            piece_shape[axis] = size
        pieces.append(got["B"].T.reshape(piece_shape))
    assert a_got is not None
    b = np.concatenate(pieces, axis=axis) if len(pieces) > 1 else pieces[0]
    return a_got, b


def _put(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


__all__ = ["PeftAdapter", "Tensors", "adapter_from_tensors", "export_peft", "is_peft_adapter",
           "lora_layers", "lora_settings", "open_weights", "peft_state", "plain_config",
           "read_peft", "read_peft_config"]
