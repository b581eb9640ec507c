"""visit / leaves / replace_config, and the "every FFN becomes MoE in ten lines" recipe."""

import dataclasses
import re
from collections import namedtuple
from typing import Any

import pytest

from jaxlearn.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigTypeError,
    Configurable,
    InstantiableConfig,
    carry_over_fields,
    leaves,
    replace_config,
    to_flat_text,
    visit,
)

# ---- toy layers (the layers package provides the real ones) -----------------------------


class FeedForward(Configurable):
    class Config(Configurable.Config):
        input_dim: int = REQUIRED
        hidden_dim: int = REQUIRED
        activation: str = "gelu"


class MixtureOfExperts(Configurable):
    class Config(Configurable.Config):
        input_dim: int = REQUIRED
        hidden_dim: int = REQUIRED
        num_experts: int = 8
        top_k: int = 2
        activation: str = "silu"
        expert: InstantiableConfig = FeedForward.default_config()


class Attention(Configurable):
    class Config(Configurable.Config):
        input_dim: int = REQUIRED
        num_heads: int = 4


class TransformerLayer(Configurable):
    class Config(Configurable.Config):
        input_dim: int = REQUIRED
        self_attention: InstantiableConfig = Attention.default_config()
        feed_forward: InstantiableConfig = FeedForward.default_config()

    def __init__(self, cfg: "TransformerLayer.Config", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        c = self.config
        self.self_attention = c.self_attention.clone(input_dim=c.input_dim).instantiate()
        self.feed_forward = c.feed_forward.clone(input_dim=c.input_dim).instantiate()


class Decoder(Configurable):
    class Config(Configurable.Config):
        input_dim: int = REQUIRED
        layers: list[InstantiableConfig] = []

    def __init__(self, cfg: "Decoder.Config", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        dim = self.config.input_dim
        self.layers = [c.clone(input_dim=dim).instantiate() for c in self.config.layers]


class Model(Configurable):
    class Config(Configurable.Config):
        decoder: InstantiableConfig = Decoder.default_config()

    def __init__(self, cfg: "Model.Config", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        self.decoder = self.config.decoder.instantiate()


def model_config(num_layers: int = 4, dim: int = 16, hidden: int = 64) -> Model.Config:
    layer = TransformerLayer.default_config()
    layer.feed_forward.set(hidden_dim=hidden)
    decoder = Decoder.default_config().set(input_dim=dim, layers=[layer] * num_layers)
    return Model.default_config().set(decoder=decoder)


# ---- the recipe from packages/config/README.md (plus type hints) ----------------------


def use_moe(model_cfg: Any, *, num_experts: int = 8, every: int = 1) -> Any:
    """Every `every`-th layer's FeedForward becomes a MixtureOfExperts."""
    moe = MixtureOfExperts.default_config().set(num_experts=num_experts)

    def is_kth_ffn(path: str, cfg: Any) -> bool:
        m = re.fullmatch(r".*layers\[(\d+)\]\.feed_forward", path)
        return isinstance(cfg, FeedForward.Config) and m is not None and int(m[1]) % every == 0

    return replace_config(model_cfg, is_kth_ffn, moe)  # carries over input_dim, hidden_dim


def _kinds(model: Model) -> list[str]:
    return [type(layer.feed_forward).__name__ for layer in model.decoder.layers]


def test_every_ffn_becomes_moe():
    cfg = model_config()
    moe_cfg = use_moe(cfg, num_experts=4)
    model = moe_cfg.instantiate()
    assert _kinds(model) == ["MixtureOfExperts"] * 4
    ffn = model.decoder.layers[2].feed_forward.config
    assert (ffn.input_dim, ffn.hidden_dim, ffn.num_experts) == (16, 64, 4)
    assert ffn.activation == "gelu"  # Shared fields are carried over from the FFN.
    assert _kinds(cfg.instantiate()) == ["FeedForward"] * 4  # The original is untouched.


def test_every_kth_ffn_becomes_moe():
    model = use_moe(model_config(num_layers=6), every=3).instantiate()
    assert _kinds(model) == ["MixtureOfExperts", "FeedForward", "FeedForward"] * 2


def test_one_line_variants_by_class_and_by_regex():
    cfg = model_config()
    by_class = replace_config(cfg, FeedForward, MixtureOfExperts)
    by_config_class = replace_config(cfg, FeedForward.Config, MixtureOfExperts.default_config())
    assert to_flat_text(by_class) == to_flat_text(by_config_class)
    assert _kinds(by_class.instantiate()) == ["MixtureOfExperts"] * 4
    odd = replace_config(cfg, r"decoder\.layers\[\d*[13579]\]\.feed_forward", MixtureOfExperts)
    assert _kinds(odd.instantiate()) == ["FeedForward", "MixtureOfExperts"] * 2


# ---- visit ------------------------------------------------------------------------------


@dataclasses.dataclass
class Span:
    start: int = 0
    stop: list = dataclasses.field(default_factory=lambda: [1])


class Holder(ConfigBase):
    tree: Any = None
    n: int = 0


def test_visit_enter_and_exit_over_every_container_kind():
    cfg = Holder(tree={"cfg": Holder(n=1), "lst": [1, (2, Span())], "empty": []})
    events: list[tuple[str, str]] = []
    visit(
        cfg,
        enter=lambda p, v: events.append(("enter", p)),
        exit=lambda p, v: events.append(("exit", p)),
    )
    entered = [p for kind, p in events if kind == "enter"]
    assert entered == [
        "",
        "tree",
        "tree.cfg",
        "tree.cfg.tree",
        "tree.cfg.n",
        "tree.lst",
        "tree.lst[0]",
        "tree.lst[1]",
        "tree.lst[1][0]",
        "tree.lst[1][1]",
        "tree.lst[1][1].start",
        "tree.lst[1][1].stop",
        "tree.lst[1][1].stop[0]",
        "tree.empty",
        "n",
    ]
    exited = [p for kind, p in events if kind == "exit"]
    assert sorted(exited) == sorted(entered)
    # Post-order: a node exits after all of its children.
    assert events.index(("exit", "tree.lst")) > events.index(("exit", "tree.lst[1][1].stop[0]"))
    assert events[-1] == ("exit", "")


def test_enter_returning_true_skips_children_and_prefix_is_prepended():
    seen: list[str] = []

    def enter(path: str, value: Any) -> bool:
        seen.append(path)
        return isinstance(value, list)

    exited: list[str] = []
    visit(Holder(tree=[[1, 2], 3]), enter, lambda p, v: exited.append(p), prefix="model")
    assert seen == ["model", "model.tree", "model.n"]
    assert exited == ["model.tree", "model.n", "model"]  # A skipped node still exits.


def test_stable_key_paths_in_a_model_tree():
    paths: list[str] = []
    visit(model_config(), lambda p, v: paths.append(p), prefix="model")
    assert "model.decoder.layers[3].feed_forward" in paths
    assert "model.decoder.layers[3].feed_forward.hidden_dim" in paths
    again: list[str] = []
    visit(model_config(), lambda p, v: again.append(p), prefix="model")
    assert paths == again


def test_leaves_lists_every_leaf_and_empty_containers():
    cfg = Holder(tree={"a": [], "b": (1, {"c": None}), "d": {}})
    assert leaves(cfg) == [
        ("tree.a", []),
        ("tree.b[0]", 1),
        ("tree.b[1].c", None),
        ("tree.d", {}),
        ("n", 0),
    ]


# ---- replace_config ---------------------------------------------------------------------


def test_replace_by_predicate_sees_paths_and_configs():
    cfg = model_config()
    seen: list[str] = []

    def match(path: str, sub: Any) -> bool:
        seen.append(path)
        return path == "decoder.layers[1].self_attention"

    new = replace_config(cfg, match, Attention.default_config().set(num_heads=16))
    assert new.decoder.layers[1].self_attention.num_heads == 16
    assert new.decoder.layers[0].self_attention.num_heads == 4
    assert "decoder.layers[3].feed_forward" in seen and "" not in seen


def test_carry_over_copies_shared_set_fields_only_and_honours_exclude():
    old = FeedForward.default_config().set(input_dim=3, hidden_dim=REQUIRED, activation="relu")
    new = MixtureOfExperts.default_config().set(hidden_dim=7)
    carry_over_fields(old, new)
    assert (new.input_dim, new.hidden_dim, new.activation) == (3, 7, "relu")
    assert new.klass is MixtureOfExperts  # klass is never carried over.
    cfg = replace_config(model_config(), FeedForward, MixtureOfExperts, exclude=("activation",))
    assert cfg.decoder.layers[0].feed_forward.activation == "silu"
    plain = replace_config(model_config(), FeedForward, MixtureOfExperts, carry_over=False)
    assert plain.decoder.layers[0].feed_forward.hidden_dim is REQUIRED


def test_what_the_replacement_sets_explicitly_wins_over_carried_values():
    moe = MixtureOfExperts.default_config().set(hidden_dim=32, activation="relu")
    cfg = replace_config(model_config(), FeedForward, moe)
    ffn = cfg.decoder.layers[0].feed_forward
    assert (ffn.hidden_dim, ffn.activation) == (32, "relu")
    everything = MixtureOfExperts.default_config().set(hidden_dim=32)
    carry_over_fields(model_config().decoder.layers[0].feed_forward, everything, keep_set=False)
    assert everything.hidden_dim == 64


def test_replacements_are_independent_copies():
    shared = MixtureOfExperts.default_config()
    cfg = replace_config(model_config(), FeedForward, lambda old, path: shared)
    layers = cfg.decoder.layers
    assert layers[0].feed_forward is not layers[1].feed_forward
    layers[0].feed_forward.num_experts = 2
    assert layers[1].feed_forward.num_experts == 8
    assert shared.input_dim is REQUIRED  # Carry-over did not write into the caller's config.


def test_callable_replacement_gets_the_old_config_and_path():
    def grow(old: Any, path: str) -> Any:
        m = re.search(r"\[(\d+)\]", path)
        assert m is not None
        index = int(m[1])
        return MixtureOfExperts.default_config().set(num_experts=2 + index, expert=old)

    cfg = replace_config(model_config(), FeedForward, grow)
    ffns = [layer.feed_forward for layer in cfg.decoder.layers]
    assert [f.num_experts for f in ffns] == [2, 3, 4, 5]
    # Matched configs are not searched again: the FFN inside the MoE stays an FFN.
    assert all(f.expert.klass is FeedForward and f.expert.hidden_dim == 64 for f in ffns)


def test_no_match_raises_unless_allowed():
    cfg = model_config()
    with pytest.raises(ConfigError, match="nothing in the tree matched"):
        replace_config(cfg, r"decoder\.layer\[0\]\.feed_forward", MixtureOfExperts)
    same = replace_config(cfg, MixtureOfExperts, FeedForward, allow_no_match=True)
    assert same == cfg and same is not cfg


def test_the_root_is_never_replaced_and_never_modified():
    cfg = model_config()
    before = to_flat_text(cfg)
    with pytest.raises(ConfigError):
        replace_config(cfg, Model, FeedForward)
    replace_config(cfg, FeedForward, MixtureOfExperts)
    assert to_flat_text(cfg) == before


def test_replacement_must_fit_the_parent_field():
    class Strict(ConfigBase):
        ffn: FeedForward.Config = FeedForward.default_config()

    with pytest.raises(ConfigTypeError, match=r"at 'ffn'"):
        replace_config(Strict(), FeedForward, MixtureOfExperts)
    with pytest.raises(ConfigError, match="not a config"):
        replace_config(model_config(), FeedForward, lambda old, path: 3)
    with pytest.raises(ConfigError, match="must be a config"):
        replace_config(model_config(), FeedForward, 3)


def test_carried_over_field_of_the_wrong_type_names_the_path():
    class Other(Configurable):
        class Config(Configurable.Config):
            hidden_dim: str = "wide"

    with pytest.raises(ConfigTypeError, match=r"decoder\.layers\[0\]\.feed_forward"):
        replace_config(model_config(), FeedForward, Other)


Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass(frozen=True)
class Frozen:
    inner: Any = None


def test_replace_inside_tuples_namedtuples_dicts_and_dataclasses():
    ffn = FeedForward.default_config().set(input_dim=1, hidden_dim=2)
    cfg = Holder(tree={"t": (ffn, 1), "p": Pair(ffn, ffn), "f": Frozen(inner=ffn)})
    new = replace_config(cfg, FeedForward, MixtureOfExperts)
    tree = new.tree
    assert type(tree["t"]) is tuple and tree["t"][0].klass is MixtureOfExperts
    assert type(tree["p"]) is Pair and tree["p"].right.klass is MixtureOfExperts
    assert type(tree["f"]) is Frozen and tree["f"].inner.klass is MixtureOfExperts
    assert cfg.tree["f"].inner.klass is FeedForward
