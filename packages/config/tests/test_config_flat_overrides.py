"""The flat text form, diffs, and `--set path=value` overrides."""

import enum
import functools
import math
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any, Callable, Literal, Optional

import pytest

import jaxlearn.config
from jaxlearn.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigTypeError,
    OverrideError,
    UnknownFieldError,
    apply_override,
    apply_overrides,
    diff_configs,
    diff_flat_texts,
    parse_value,
    to_flat_dict,
    to_flat_text,
)


class Color(enum.Enum):
    RED = 1
    GREEN = 2


class Optimizer(ConfigBase):
    learning_rate: float = 1e-3
    schedule: Callable[..., Any] = math.cos
    name: str = "adam"
    betas: tuple[float, float] = (0.9, 0.999)


class Layer(ConfigBase):
    dim: int = REQUIRED
    names: list[str] = ["q", "k"]
    color: Color = Color.RED
    mode: Literal["fast", "exact"] = "fast"
    scale: Optional[float] = None


class Decoder(ConfigBase):
    num_layers: int = 2
    layers: list[Layer] = [Layer(), Layer()]
    table: dict[str, int] = {"b": 2, "a": 1}


class Learner(ConfigBase):
    optimizer: Optimizer = Optimizer()
    klass: type = dict


class Trainer(ConfigBase):
    decoder: Decoder = Decoder()
    learner: Learner = Learner()
    seed: int = 0
    tags: Any = None


EXPECTED = """\
decoder.layers[0].color: test_config_flat_overrides.Color.RED
decoder.layers[0].dim: REQUIRED
decoder.layers[0].mode: 'fast'
decoder.layers[0].names: ['q', 'k']
decoder.layers[0].scale: None
decoder.layers[1].color: test_config_flat_overrides.Color.RED
decoder.layers[1].dim: REQUIRED
decoder.layers[1].mode: 'fast'
decoder.layers[1].names: ['q', 'k']
decoder.layers[1].scale: None
decoder.num_layers: 2
decoder.table.a: 1
decoder.table.b: 2
learner.klass: builtins.dict
learner.optimizer.betas: (0.9, 0.999)
learner.optimizer.learning_rate: 0.001
learner.optimizer.name: 'adam'
learner.optimizer.schedule: math.cos
seed: 0
tags: None
"""


# ---- flat text --------------------------------------------------------------------------


def test_flat_text_is_sorted_path_value_lines():
    assert to_flat_text(Trainer()) == EXPECTED
    flat = to_flat_dict(Trainer())
    assert "".join(f"{k}: {v}\n" for k, v in flat.items()) == EXPECTED


def test_flat_text_orders_indices_numerically():
    cfg = Trainer(tags=[{"i": i} for i in range(12)])
    paths = [line.split(": ")[0] for line in to_flat_text(cfg).splitlines()]
    tags = [p for p in paths if p.startswith("tags")]
    assert tags == [f"tags[{i}].i" for i in range(12)]  # tags[2] before tags[10].


def test_flat_text_prints_literal_sequences_on_one_line():
    cfg = Trainer(tags={"shape": (1, -1, 2), "rules": (("batch", ("data", "fsdp")), ("x", None))})
    flat = to_flat_dict(cfg)
    assert flat["tags.shape"] == "(1, -1, 2)"
    assert flat["tags.rules"] == "(('batch', ('data', 'fsdp')), ('x', None))"
    mixed = to_flat_dict(Trainer(tags=[1, Optimizer()]))
    assert mixed["tags[0]"] == "1" and "tags[1].name" in mixed


def test_flat_text_renders_values_deterministically():
    tags = {
        "set": {"b", "a", "c"},
        "frozen": frozenset({3, 1}),
        "empty": set(),
        "partial": functools.partial(round, 2.5, ndigits=3),
        "float": float("inf"),
        "bytes": b"x",
        "type": int,
    }
    flat = to_flat_dict(Trainer(tags=tags))
    assert flat["tags.set"] == "{'a', 'b', 'c'}"
    assert flat["tags.frozen"] == "frozenset({1, 3})"
    assert flat["tags.empty"] == "set()"
    assert flat["tags.partial"] == "partial(builtins.round, 2.5, ndigits=3)"
    assert flat["tags.float"] == "inf"
    assert flat["tags.bytes"] == "b'x'"
    assert flat["tags.type"] == "builtins.int"


_SCRIPT = textwrap.dedent(
    """
    from jaxlearn.config import ConfigBase, to_flat_text
    class C(ConfigBase):
        names: frozenset = frozenset(f"name{i}" for i in range(20))
        table: dict = {f"k{i}": {"x", f"y{i}", "z"} for i in range(5)}
    print(to_flat_text(C()), end="")
    """
)


def _flat_text_in_a_subprocess(seed: str) -> str:
    src = pathlib.Path(jaxlearn.config.__file__).parents[2]
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout


def test_flat_text_is_the_same_across_processes_with_different_hash_seeds():
    texts = {_flat_text_in_a_subprocess(seed) for seed in ("1", "2", "3")}
    assert len(texts) == 1
    text = texts.pop()
    assert "names: frozenset({'name0', 'name1', 'name10'" in text
    assert "table.k0: {'x', 'y0', 'z'}\n" in text


class Opaque:
    pass


class WithMethod:
    def method(self) -> None:
        pass


@pytest.mark.parametrize("value", [Opaque(), [1, Opaque()], WithMethod().method, [].append])
def test_values_without_a_deterministic_form_raise_with_the_path(value):
    with pytest.raises(ConfigError, match=r"^tags.*no deterministic text form"):
        to_flat_text(Trainer(tags=value))


def test_leaves_that_format_alike_are_reported():
    with pytest.raises(ConfigError, match="share the path"):
        to_flat_dict(Trainer(tags={1.5: "a", "1.5": "b"}))


# ---- diffs ------------------------------------------------------------------------------


def test_diff_configs_lists_changed_added_and_removed_paths():
    a = Trainer()
    b = a.clone(seed=3, tags={"new": 1})
    b.decoder.layers = [Layer(dim=4)]
    diff = diff_configs(a, b).splitlines()
    assert "~ seed: 0 -> 3" in diff
    assert "~ decoder.layers[0].dim: REQUIRED -> 4" in diff
    assert "+ tags.new: 1" in diff
    assert "- tags: None" in diff
    assert "- decoder.layers[1].dim: REQUIRED" in diff
    assert all(line[:2] in ("~ ", "+ ", "- ") for line in diff)
    assert diff_configs(a, a.clone()) == ""


def test_diff_flat_texts_is_a_unified_diff():
    a = to_flat_text(Trainer())
    b = to_flat_text(Trainer(seed=1))
    diff = diff_flat_texts(a, b, "golden", "current")
    assert diff.splitlines()[:2] == ["--- golden", "+++ current"]
    assert "-seed: 0" in diff.splitlines() and "+seed: 1" in diff.splitlines()
    assert diff_flat_texts(a, a) == ""


# ---- overrides --------------------------------------------------------------------------


def test_overrides_set_typed_values_and_show_in_the_flat_text():
    cfg = apply_overrides(
        Trainer(),
        [
            "decoder.num_layers=4",
            "learner.optimizer.learning_rate=3e-4",
            "decoder.layers[1].dim = 8",
            "seed=7",
        ],
    )
    assert cfg.decoder.num_layers == 4 and cfg.learner.optimizer.learning_rate == 3e-4
    flat = to_flat_dict(cfg)
    assert flat["decoder.num_layers"] == "4"
    assert flat["learner.optimizer.learning_rate"] == "0.0003"
    assert flat["decoder.layers[1].dim"] == "8" and flat["seed"] == "7"
    assert diff_configs(Trainer(), cfg).count("\n") == 3  # Exactly the four overrides.


def test_str_fields_take_raw_text_or_a_quoted_literal():
    cfg = Trainer()
    apply_override(cfg, "learner.optimizer.name=sgd")
    assert cfg.learner.optimizer.name == "sgd"
    apply_override(cfg, "learner.optimizer.name='with spaces = ok'")
    assert cfg.learner.optimizer.name == "with spaces = ok"
    apply_override(cfg, "learner.optimizer.name=42")
    assert cfg.learner.optimizer.name == "42"
    apply_override(cfg, "decoder.layers[0].names[1]=value")  # list[str] items are str too.
    assert cfg.decoder.layers[0].names == ["q", "value"]


def test_dotted_import_paths_for_type_and_callable_fields():
    cfg = Trainer()
    apply_override(cfg, "learner.klass=collections.OrderedDict")
    apply_override(cfg, "learner.optimizer.schedule=math.sin")
    import collections

    assert cfg.learner.klass is collections.OrderedDict
    assert cfg.learner.optimizer.schedule is math.sin
    flat = to_flat_dict(cfg)
    assert flat["learner.klass"] == "collections.OrderedDict"
    assert flat["learner.optimizer.schedule"] == "math.sin"
    with pytest.raises(ConfigTypeError, match="learner.klass"):
        apply_override(cfg, "learner.klass=math.sin")  # Importable, but not a type.
    with pytest.raises(OverrideError, match="learner.klass"):
        apply_override(cfg, "learner.klass=no_such_module.Thing")


def test_enum_and_literal_fields():
    cfg = Trainer()
    apply_override(cfg, "decoder.layers[0].color=GREEN")
    apply_override(cfg, "decoder.layers[1].color=test_config_flat_overrides.Color.GREEN")
    apply_override(cfg, "decoder.layers[0].mode=exact")
    assert [layer.color for layer in cfg.decoder.layers] == [Color.GREEN, Color.GREEN]
    assert cfg.decoder.layers[0].mode == "exact"
    with pytest.raises(ConfigError, match=r"decoder\.layers\[0\]\.mode"):
        apply_override(cfg, "decoder.layers[0].mode=slow")


def test_values_are_parsed_as_literals_never_evaluated(tmp_path):
    marker = tmp_path / "ran"
    cfg = Trainer()
    with pytest.raises(OverrideError, match="cannot parse"):
        apply_override(cfg, f"tags=open({str(marker)!r}, 'w')")
    with pytest.raises(OverrideError, match="cannot parse"):
        apply_override(cfg, "tags=__import__('os').getcwd()")
    with pytest.raises(OverrideError):
        apply_override(cfg, "seed=1+1j*0 if True else 2")
    assert not marker.exists() and cfg.tags is None
    apply_override(cfg, "tags={'a': [1, (2, None)], 'b': {3}}")
    assert cfg.tags == {"a": [1, (2, None)], "b": {3}}


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("seed=seven", r"seed: cannot parse 'seven'"),
        ("seed=1.5", r"seed: expects int, got float"),
        ("seed=True", r"seed: expects int, got bool"),
        ("decoder.layers[0].dim='8'", r"decoder\.layers\[0\]\.dim: expects int, got str"),
        ("learner.optimizer.betas[0]=x", r"learner\.optimizer\.betas\[0\]"),
        ("decoder.table.a=1.0", r"decoder\.table\.a"),
    ],
)
def test_type_errors_name_the_path(override, pattern):
    cfg = Trainer()
    before = to_flat_text(cfg)
    with pytest.raises(ConfigError, match=pattern) as info:
        apply_overrides(cfg, [override])
    assert str(info.value).startswith(f"--set {override}: ")
    assert to_flat_text(cfg) == before


@pytest.mark.parametrize(
    "override,pattern",
    [
        ("decoder.num_layer=4", "did you mean: num_layers"),
        ("decodr.num_layers=4", "did you mean: decoder"),
        ("learner.optimizer.learning_rat=1.0", "did you mean: learning_rate"),
        ("decoder.layers[2].dim=1", "out of range"),
        ("decoder.layers[0].dims=1", "did you mean: dim"),
    ],
)
def test_unknown_paths_raise_with_a_suggestion(override, pattern):
    with pytest.raises(UnknownFieldError, match=pattern) as info:
        apply_overrides(Trainer(), [override])
    assert "Unknown config path" in str(info.value)


@pytest.mark.parametrize("override", ["seed", "=3", "a..b=3"])
def test_malformed_overrides_raise(override):
    with pytest.raises(ConfigError):
        apply_override(Trainer(), override)


def test_special_values():
    cfg = Trainer()
    apply_override(cfg, "learner.optimizer.learning_rate=nan")
    assert math.isnan(cfg.learner.optimizer.learning_rate)
    apply_override(cfg, "learner.optimizer.learning_rate=-inf")
    assert cfg.learner.optimizer.learning_rate == -math.inf
    apply_override(cfg, "decoder.layers[0].scale=None")
    apply_override(cfg, "decoder.num_layers=REQUIRED")  # Unset a field again.
    assert cfg.decoder.num_layers is REQUIRED
    apply_override(cfg, "learner.optimizer.name='REQUIRED'")  # Quoted: the string.
    assert cfg.learner.optimizer.name == "REQUIRED"
    cfg.tags = {"a=b": 1}
    apply_override(cfg, "tags['a=b']=2")  # An '=' inside a quoted key is part of the path.
    assert cfg.tags == {"a=b": 2}


def test_parse_value_directly():
    assert parse_value("3", int) == 3
    assert parse_value(" 3 ", float) == 3
    assert parse_value("[1, 2]", list[int]) == [1, 2]
    assert parse_value("x", Optional[str]) == "x"
    assert parse_value("None", Optional[str]) is None
    assert parse_value("math.pi", Any) == math.pi
    with pytest.raises(OverrideError):
        parse_value("os.sep", int)  # Not imported for a literal-only field.


def test_every_flat_line_is_a_valid_override():
    cfg = Trainer(seed=5, tags={"x y": [1.5, "s'q\"d"], "k": (None, b"b")})
    cfg.decoder.layers[1].set(dim=3, color=Color.GREEN, scale=float("nan"))
    cfg.learner.set(klass=collections_ordered_dict())
    fresh = Trainer(tags={"x y": [0, 0], "k": (0, 0)})
    apply_overrides(fresh, [f"{k}={v}" for k, v in to_flat_dict(cfg).items()])
    assert to_flat_text(fresh) == to_flat_text(cfg)


def collections_ordered_dict() -> type:
    import collections

    return collections.OrderedDict
