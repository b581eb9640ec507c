"""ConfigBase: fields, defaults, REQUIRED, unknown fields, type validation, copying, paths."""

import collections.abc
import copy
import dataclasses
import math
import pickle
import typing
from typing import Any, Callable, ClassVar, Literal, Optional, Union

import pytest

from jaxlearn.config import (
    REQUIRED,
    ConfigBase,
    ConfigError,
    ConfigTypeError,
    RequiredFieldError,
    UnknownFieldError,
    format_path,
    parse_path,
)


class Rope(ConfigBase):
    theta: float = 10000.0


class Attention(ConfigBase):
    num_heads: int = REQUIRED
    head_dim: int = 64
    rope: Optional[Rope] = None
    dims: list[int] = []


class Base(ConfigBase):
    a: int = 1
    b: str = "x"


class Child(Base):
    c: float = 2.5
    a: int = 10  # Re-annotated default.


class Unannotated(Base):
    b = "changed"  # New default for an inherited field, without repeating the annotation.


class WithExtras(ConfigBase):
    counter: ClassVar[int] = 0
    _private: int = 3
    value: int = 0


class Typed(ConfigBase):
    i: int = 0
    f: float = 0.0
    s: str = ""
    flag: bool = False
    maybe: Optional[int] = None
    either: Union[int, str] = 0
    mode: Literal["a", "b"] = "a"
    ints: list[int] = []
    table: dict[str, int] = {}
    pair: tuple[int, str] = (0, "")
    many: tuple[int, ...] = ()
    klass: type[collections.abc.Sequence] = list
    fn: Callable[[float], float] = math.sqrt
    rope: Rope = Rope()
    anything: Any = None


@dataclasses.dataclass(frozen=True)
class Point:
    x: int = 0
    y: int = 0


class Tree(ConfigBase):
    attention: Attention = Attention()
    entries: list[Any] = []
    pairs: tuple[int, ...] = ()
    table: dict[Any, Any] = {}
    point: Point = Point()


# ---- fields and defaults ----------------------------------------------------------------


def test_fields_in_declaration_order_with_defaults():
    cfg = Attention()
    assert cfg.keys() == ["num_heads", "head_dim", "rope", "dims"]
    assert cfg.head_dim == 64 and cfg.rope is None and cfg.dims == []
    assert cfg.num_heads is REQUIRED
    assert "head_dim" in cfg and "nope" not in cfg
    assert cfg.items()[1] == ("head_dim", 64)


def test_constructor_kwargs_are_set_and_validated():
    assert Attention(num_heads=4, head_dim=32).num_heads == 4
    with pytest.raises(ConfigTypeError):
        Attention(num_heads="four")
    with pytest.raises(UnknownFieldError):
        Attention(num_head=4)


def test_inheritance_and_default_overrides():
    assert Child().keys() == ["a", "b", "c"]
    assert (Child().a, Child().b, Child().c) == (10, "x", 2.5)
    assert Base().a == 1  # The parent is unchanged.
    assert Unannotated().b == "changed"
    assert Base().b == "x"


def test_classvars_and_private_names_are_not_fields():
    assert WithExtras().keys() == ["value"]


def test_mutable_defaults_are_not_shared_between_instances():
    one, two = Attention(), Attention()
    one.dims.append(3)
    assert two.dims == [] and Attention().dims == []
    tree_one, tree_two = Tree(), Tree()
    tree_one.attention.head_dim = 8
    assert tree_two.attention.head_dim == 64


def test_field_that_shadows_a_method_is_rejected():
    with pytest.raises(ConfigError, match="shadow"):

        class Bad(ConfigBase):
            items: list[int] = []  # type: ignore[assignment]


def test_default_that_does_not_match_its_annotation_raises_on_first_use():
    class BadDefault(ConfigBase):
        n: int = "three"  # type: ignore[assignment]

    with pytest.raises(ConfigTypeError, match=r"BadDefault\.n"):
        BadDefault()


def test_forward_references_resolve_field_by_field():
    class Local(ConfigBase):
        rope: "Rope" = Rope()
        other: "NotDefinedAnywhere" = None  # type: ignore[name-defined]  # noqa: F821

    cfg = Local()
    with pytest.raises(ConfigTypeError):
        cfg.rope = 3  # type: ignore[assignment]  # Resolved although `other` is not.
    cfg.other = 3
    assert cfg.other == 3


# ---- REQUIRED ---------------------------------------------------------------------------

_USES = {
    "bool": lambda r: bool(r),
    "if": lambda r: 1 if r else 0,
    "int": lambda r: int(r),
    "float": lambda r: float(r),
    "index": lambda r: range(r),
    "len": lambda r: len(r),
    "iter": lambda r: list(r),
    "add": lambda r: r + 1,
    "radd": lambda r: 1 + r,
    "mul": lambda r: 2 * r,
    "div": lambda r: r / 2,
    "floordiv": lambda r: 4 // r,
    "mod": lambda r: r % 2,
    "pow": lambda r: r**2,
    "neg": lambda r: -r,
    "lt": lambda r: r < 1,
    "ge": lambda r: 1 >= r,
    "getitem": lambda r: r[0],
    "call": lambda r: r(),
    "attr": lambda r: r.shape,
    "matmul": lambda r: r @ r,
    "contains": lambda r: 1 in r,
    "round": lambda r: round(r),
}


@pytest.mark.parametrize("use", sorted(_USES))
def test_any_use_of_required_raises(use):
    with pytest.raises(RequiredFieldError):
        _USES[use](Attention().num_heads)


def test_required_identity_survives_copy_pickle_and_compares():
    assert copy.copy(REQUIRED) is REQUIRED
    assert copy.deepcopy(REQUIRED) is REQUIRED
    assert pickle.loads(pickle.dumps(REQUIRED)) is REQUIRED
    assert repr(REQUIRED) == "REQUIRED" and f"{REQUIRED}" == "REQUIRED"
    assert REQUIRED == REQUIRED and REQUIRED != 0
    assert not hasattr(REQUIRED, "shape")  # hasattr probes see "absent", not a crash.


def test_check_required_lists_every_missing_field_with_its_path():
    cfg = Tree(entries=[Attention(), {"x": REQUIRED}])
    with pytest.raises(RequiredFieldError) as info:
        cfg.check_required(prefix="model")
    message = str(info.value)
    for path in ["model.attention.num_heads", "model.entries[0].num_heads", "model.entries[1].x"]:
        assert path in message
    assert Tree().missing_fields() == ["attention.num_heads"]
    Attention(num_heads=2).check_required()  # Nothing missing: no error.


# ---- unknown fields ---------------------------------------------------------------------


def test_unknown_field_suggests_the_closest_name():
    cfg = Attention()
    with pytest.raises(UnknownFieldError, match="did you mean: num_heads"):
        cfg.num_head = 4
    with pytest.raises(UnknownFieldError, match="did you mean: head_dim"):
        _ = cfg.head_dims
    with pytest.raises(UnknownFieldError, match="did you mean: head_dim"):
        cfg.set(headdim=3)
    with pytest.raises(UnknownFieldError) as info:
        cfg.zzzz = 1
    assert "did you mean" not in str(info.value)


def test_unknown_field_error_is_an_attribute_error_and_a_config_error():
    cfg = Attention()
    assert not hasattr(cfg, "num_head")
    assert issubclass(UnknownFieldError, AttributeError)
    assert issubclass(UnknownFieldError, ConfigError)


# ---- type validation --------------------------------------------------------------------

_GOOD = [
    ("i", 3),
    ("f", 3),
    ("f", 2.5),
    ("s", "hi"),
    ("flag", True),
    ("maybe", None),
    ("maybe", 4),
    ("either", "x"),
    ("either", 5),
    ("mode", "b"),
    ("ints", [1, 2]),
    ("table", {"a": 1}),
    ("pair", (1, "a")),
    ("many", (1, 2, 3)),
    ("klass", tuple),
    ("fn", math.floor),
    ("rope", Rope(theta=1.0)),
    ("anything", object),
    ("i", REQUIRED),
]
_BAD = [
    ("i", True),
    ("i", 2.0),
    ("i", "3"),
    ("f", "1.0"),
    ("f", False),
    ("s", 3),
    ("flag", 1),
    ("maybe", "4"),
    ("either", 1.5),
    ("mode", "c"),
    ("ints", [1, "2"]),
    ("ints", (1, 2)),
    ("table", {1: 1}),
    ("table", {"a": "b"}),
    ("pair", (1, 2)),
    ("pair", (1, "a", 3)),
    ("many", (1, "x")),
    ("klass", dict),
    ("klass", [1]),
    ("fn", 3),
    ("rope", Attention()),
]


@pytest.mark.parametrize("name,value", _GOOD, ids=lambda v: repr(v)[:20])
def test_values_that_match_the_annotation_are_accepted(name, value):
    cfg = Typed()
    cfg.set(**{name: value})
    assert getattr(cfg, name) == value or getattr(cfg, name) is value


@pytest.mark.parametrize("name,value", _BAD, ids=lambda v: repr(v)[:20])
def test_values_that_do_not_match_the_annotation_raise(name, value):
    cfg = Typed()
    before = getattr(cfg, name)
    with pytest.raises(ConfigTypeError, match=rf"Typed\.{name} expects"):
        cfg.set(**{name: value})
    assert getattr(cfg, name) == before  # A failed set leaves the field unchanged.


def test_type_error_is_also_a_type_error():
    assert issubclass(ConfigTypeError, TypeError)
    with pytest.raises(TypeError):
        Typed().i = "x"  # type: ignore[assignment]


# ---- copying ----------------------------------------------------------------------------


def test_set_deep_copies_values():
    dims = [1, 2]
    cfg = Attention(dims=dims)
    dims.append(3)
    assert cfg.dims == [1, 2]
    rope = Rope(theta=1.0)
    one, two = Attention(rope=rope), Attention(rope=rope)
    rope.theta = 5.0
    assert one.rope is not None and two.rope is not None
    one.rope.theta = 7.0
    assert two.rope.theta == 1.0 and one.rope is not two.rope


def test_repeated_objects_become_independent_copies():
    rope = Rope()
    cfg = Tree(entries=[rope] * 3, table={"a": rope, "b": [rope]})
    cfg.set_recursively("entries[0].theta", 1.0)
    cfg.set_recursively("table.a.theta", 2.0)
    assert [r.theta for r in cfg.entries] == [1.0, 10000.0, 10000.0]
    assert cfg.table["b"][0].theta == 10000.0
    clone = cfg.clone()
    assert clone.entries[1] is not clone.entries[2]


def test_a_value_that_contains_itself_is_rejected():
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ConfigError, match="contains itself"):
        Tree(entries=loop)


def test_functions_and_classes_are_shared_not_copied():
    cfg = Typed(fn=math.floor, klass=tuple)
    assert cfg.fn is math.floor and cfg.klass is tuple
    assert cfg.clone().fn is math.floor


def test_set_chains_and_clone_is_independent():
    cfg = Attention()
    assert cfg.set(num_heads=2).set(head_dim=8) is cfg
    copy_ = cfg.clone(head_dim=16, rope=Rope())
    assert (copy_.num_heads, copy_.head_dim, cfg.head_dim, cfg.rope) == (2, 16, 8, None)
    assert copy_.rope is not None
    copy_.rope.theta = 1.0
    copy_.dims.append(1)
    assert cfg.dims == [] and cfg.rope is None
    deep = copy.deepcopy(cfg)
    assert deep == cfg and deep is not cfg and deep.dims is not cfg.dims


def test_equality_and_repr():
    assert Attention(num_heads=2) == Attention(num_heads=2)
    assert Attention(num_heads=2) != Attention(num_heads=3)
    assert Base() != Unannotated() and Base() != {"a": 1, "b": "x"}
    assert repr(Rope()) == "Rope(theta=10000.0)"
    with pytest.raises(TypeError):
        hash(Rope())


def test_field_type_reports_annotations():
    assert Typed().field_type("ints") == list[int]
    assert Typed().field_type("maybe") == typing.Optional[int]
    with pytest.raises(UnknownFieldError):
        Typed().field_type("nope")


# ---- paths ------------------------------------------------------------------------------


def test_parse_and_format_paths():
    assert parse_path("model.decoder.layers[3].feed_forward") == [
        "model",
        "decoder",
        "layers",
        3,
        "feed_forward",
    ]
    assert parse_path("d['x y'][\"a.b\"][-1]") == ["d", "x y", "a.b", -1]
    assert parse_path("") == []
    for keys in (["a", 0, "b"], ["d", "x y", 2], [0, "a"], ["a", "1"]):
        assert parse_path(format_path(keys)) == keys
    assert format_path(["a", True]) == "a['True']"  # A bool key is not an index.


@pytest.mark.parametrize("bad", [".a", "a.", "a..b", "a[x]", "a b", "a[1"])
def test_malformed_paths_raise(bad):
    with pytest.raises(ConfigError, match="Malformed"):
        parse_path(bad)


def _tree() -> Tree:
    return Tree(
        entries=[Rope(), [1, 2]],
        pairs=(1, 2, 3),
        table={"k": 1, "x y": Rope(), 7: "seven"},
        point=Point(1, 2),
    )


def test_get_recursively_through_every_kind_of_container():
    cfg = _tree()
    assert cfg.get_recursively("attention.head_dim") == 64
    assert cfg.get_recursively("entries[0].theta") == 10000.0
    assert cfg.get_recursively("entries[1][-1]") == 2
    assert cfg.get_recursively("pairs[2]") == 3
    assert cfg.get_recursively("table['x y'].theta") == 10000.0
    assert cfg.get_recursively("table[7]") == "seven"
    assert cfg.get_recursively("table.k") == 1
    assert cfg.get_recursively("point.y") == 2
    assert cfg.get_recursively(["entries", 1, 0]) == 1
    assert cfg.get_recursively("") is cfg


@pytest.mark.parametrize(
    "path,pattern",
    [
        ("atention.head_dim", "did you mean: attention"),
        ("attention.head_dimm", "did you mean: head_dim"),
        ("entries[5]", "out of range"),
        ("table.kk", "did you mean: k"),
        ("point.z", "Point has no field 'z'"),
        ("attention.head_dim.x", "cannot index a int"),
    ],
)
def test_get_recursively_unknown_paths_raise_with_the_path(path, pattern):
    with pytest.raises(UnknownFieldError, match=pattern) as info:
        _tree().get_recursively(path)
    assert "Unknown config path" in str(info.value)


def test_set_recursively_sets_through_containers():
    cfg = _tree()
    cfg.set_recursively("attention.head_dim", 32)
    cfg.set_recursively("entries[0].theta", 1.0)
    cfg.set_recursively("entries[1][0]", 9)
    cfg.set_recursively("pairs[1]", 20)
    cfg.set_recursively("table['x y'].theta", 2.0)
    cfg.set_recursively("table.new", 5)  # Dicts may grow.
    cfg.set_recursively("point.x", 7)  # A frozen dataclass is rebuilt.
    assert cfg.attention.head_dim == 32
    assert cfg.entries[0].theta == 1.0 and cfg.entries[1] == [9, 2]
    assert cfg.pairs == (1, 20, 3)
    assert cfg.table["x y"].theta == 2.0 and cfg.table["new"] == 5
    assert cfg.point == Point(7, 2)


def test_set_recursively_validates_against_the_owning_field():
    cfg = Tree(attention=Attention(num_heads=1))
    with pytest.raises(ConfigTypeError, match=r"^attention\.num_heads: Attention\.num_heads"):
        cfg.set_recursively("attention.num_heads", "many")
    cfg.set_recursively("attention.dims", [1, 2])
    with pytest.raises(ConfigTypeError, match=r"attention\.dims\[0\]"):
        cfg.set_recursively("attention.dims[0]", "x")  # list[int] is checked per item.
    with pytest.raises(ConfigTypeError, match=r"pairs\[0\]"):
        Tree(pairs=(1,)).set_recursively("pairs[0]", "x")
    assert cfg.attention.num_heads == 1 and cfg.attention.dims == [1, 2]


def test_set_recursively_does_not_alias_the_value():
    cfg, value = Tree(entries=[[]]), [1]
    cfg.set_recursively("entries[0]", value)
    value.append(2)
    assert cfg.entries == [[1]]


def test_set_recursively_unknown_or_empty_path_raises():
    with pytest.raises(UnknownFieldError, match="did you mean: head_dim"):
        Tree().set_recursively("attention.head_dimm", 3)
    with pytest.raises(UnknownFieldError, match="out of range"):
        Tree(entries=[1]).set_recursively("entries[3]", 3)
    with pytest.raises(ConfigError, match="non-empty"):
        Tree().set_recursively("", 3)
