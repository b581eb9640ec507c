"""Format-neutral parameter trees: per-layer dicts in the jaxlearn layout <-> the nested
params of a `CausalLM` (scanned stacks stack the layers on a leading axis, loop stacks keep
`layer0..layerN-1`), checked against `create_parameter_specs_recursively()`.

"Canonical" form used by every converter:
  top    = {"emb": {"weight"}, "output_norm": {"scale"}, "lm_head": {"weight"} (untied)}
  layers = [{"attention_norm": {"scale"}, "self_attention": {...}, "ffn_norm": {"scale"},
             "feed_forward": {...}}, ...]   (numpy arrays, jaxlearn shapes)
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from jaxlearn.families.errors import ParameterMismatchError
from jaxlearn.layers import LoopStack, ScanStack
from jaxlearn.module import ParameterSpec, is_spec

Nested = dict[str, Any]


def flatten(tree: Nested, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": x}} -> {"a.b": x} (dict leaves only; ParameterSpecs are leaves)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def stack_kind(model: Any) -> str:
    stack = model.decoder.transformer
    if isinstance(stack, ScanStack):
        return "scan"
    if isinstance(stack, LoopStack):
        return "loop"
    raise TypeError(f"{stack.path()}: unsupported stack {type(stack).__name__}")


def group_size(model: Any) -> Optional[int]:
    """p when `model`'s stack scans a `LoopStack` group of p layers (`stack_config`):
    layer i is at `layer.layer{i % p}[i // p]`; None otherwise."""
    stack = model.decoder.transformer
    group = stack.children.get("layer") if isinstance(stack, ScanStack) else None
    return len(group.children) if isinstance(group, LoopStack) else None


def stack_layers(stacked: Nested, num_layers: int, p: Optional[int]) -> list[Nested]:
    """A scanned stack's `layer` params (grouped by p: `layer{k}` each [n / p, ...]) ->
    one tree per layer."""
    if p is None:
        return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(num_layers)]
    return [
        jax.tree.map(lambda a, i=i: a[i // p], stacked.get(f"layer{i % p}", {}))
        for i in range(num_layers)
    ]


def layer_layouts(model: Any) -> list[frozenset[str]]:
    """Per layer of `model`'s stack: the fused parameter layouts its config asks for
    ("fused_qkv": a `qkv_proj` child; "fused_gate": a `wi_fused` child), see
    `names.FUSIONS`."""
    from jaxlearn.families.arch import layer_configs

    out = []
    for lc in layer_configs(model.decoder.transformer.config):
        flags = {
            "fused_qkv": getattr(lc.self_attention, "qkv_proj", None) is not None,
            "fused_gate": getattr(lc.feed_forward, "wi_fused", None) is not None,
        }
        out.append(frozenset(k for k, v in flags.items() if v))
    return out


def assemble_params(
    model: Any, top: Nested, layers: list[Nested], *, source: str, names: Optional[dict] = None
) -> Nested:
    """Canonical (top, layers) -> the model's params, checked and cast to the spec dtypes.

    `names` maps jaxlearn paths (e.g.
    "decoder.transformer.layer3.self_attention.q_proj.weight") to checkpoint tensor names
    for the error message.
    """
    kind, p = stack_kind(model), group_size(model)
    transformer: Nested
    if kind == "scan":
        structures = {jax.tree.structure(layer) for layer in layers}
        if len(structures) > 1:
            raise ParameterMismatchError(
                source, mismatched=["layers have different parameter sets; use stack='loop'"]
            )
        stack = lambda ls: jax.tree.map(lambda *a: np.stack(a), *ls)  # noqa: E731
        if p is None:
            transformer = {"layer": stack(layers)} if layers else {}
        else:
            transformer = {"layer": {f"layer{k}": stack(layers[k::p]) for k in range(p)}}
    else:
        transformer = {f"layer{i}": layer for i, layer in enumerate(layers)}
    params = {"decoder": dict(top, transformer=transformer)}
    return check_params(model, params, source=source, names=names)


def check_params(
    model: Any, params: Nested, *, source: str, names: Optional[dict] = None
) -> Nested:
    """Checks `params` against the model's parameter specs (same paths, same shapes) and
    casts each leaf to its spec dtype (numpy). Raises ParameterMismatchError listing every
    missing, unexpected and mis-shaped parameter."""
    specs = flatten(model.create_parameter_specs_recursively())
    got = flatten(params)
    names = names or {}

    def label(path: str) -> str:
        return f"{path} (checkpoint: {names[path]})" if path in names else path

    missing = [label(p) for p in specs if p not in got]
    unexpected = [label(p) for p in got if p not in specs]
    mismatched = []
    for path, spec in specs.items():
        if path in got and tuple(np.shape(got[path])) != tuple(spec.shape):
            mismatched.append(
                f"{label(path)}: got {tuple(np.shape(got[path]))}, expected {tuple(spec.shape)}"
            )
    if missing or unexpected or mismatched:
        raise ParameterMismatchError(
            source, missing=missing, unexpected=unexpected, mismatched=mismatched
        )

    def cast(spec: ParameterSpec, value: Any) -> Any:
        return np.asarray(value).astype(spec.dtype, copy=False)

    spec_tree = model.create_parameter_specs_recursively()
    return jax.tree.map(
        lambda s, v: cast(s, v), spec_tree, _restrict(params, spec_tree), is_leaf=is_spec
    )


def _restrict(params: Nested, like: Nested) -> Nested:
    return {
        k: _restrict(params[k], v) if isinstance(v, dict) else params[k] for k, v in like.items()
    }


def split_params(model: Any, params: Nested) -> tuple[Nested, list[Nested]]:
    """The model's params -> canonical (top, layers) with numpy leaves."""
    params = jax.tree.map(np.asarray, check_params(model, params, source="params"))
    decoder = dict(params["decoder"])
    transformer = decoder.pop("transformer", {})
    n = model.decoder.transformer.config.num_layers
    if stack_kind(model) == "scan":
        n *= group_size(model) or 1
        layers = stack_layers(transformer.get("layer", {}), n, group_size(model))
    else:
        layers = [transformer.get(f"layer{i}", {}) for i in range(n)]
    return decoder, layers
