"""Hypothesis properties: clone independence, flat-form round trips, traversal coverage."""

import dataclasses
import enum
import math
from typing import Any, Callable, Optional

from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.config import (
    REQUIRED,
    ConfigBase,
    apply_overrides,
    leaves,
    to_flat_dict,
    to_flat_text,
    visit,
)
from jaxlearn.config.flat import path_sort_key


class Color(enum.Enum):
    RED = 1
    GREEN = 2


class Leaf(ConfigBase):
    i: int = 0
    f: float = 0.0
    s: str = ""
    b: bool = False
    o: Optional[int] = None
    ints: list[int] = [0, 0, 0]
    pair: tuple[int, str] = (0, "")
    color: Color = Color.RED
    fn: Callable[..., Any] = math.cos


class Root(ConfigBase):
    leaf: Leaf = Leaf()
    leaves: list[Leaf] = [Leaf(), Leaf()]
    table: dict[str, float] = {"a": 0.0, "x y": 0.0, "a=b": 0.0}
    name: str = REQUIRED


def _maybe_required(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.just(REQUIRED), strategy)


floats = st.one_of(st.floats(), st.integers(-(10**20), 10**20))
leaf_configs = st.builds(
    Leaf,
    i=_maybe_required(st.integers()),
    f=floats,
    s=_maybe_required(st.text()),
    b=st.booleans(),
    o=st.one_of(st.none(), st.integers()),
    ints=st.lists(st.integers(), min_size=3, max_size=3),
    pair=st.tuples(st.integers(), st.text()),
    color=st.sampled_from(Color),
    fn=st.sampled_from([math.sin, math.floor, len, abs]),
)
roots = st.builds(
    Root,
    leaf=leaf_configs,
    leaves=st.lists(leaf_configs, min_size=2, max_size=2),
    table=st.fixed_dictionaries({"a": floats, "x y": floats, "a=b": floats}),
    name=_maybe_required(st.text()),
)


# ---- clone independence -----------------------------------------------------------------

MUTATIONS: list[Callable[[Root, int], Any]] = [
    lambda c, n: c.leaf.ints.append(n),
    lambda c, n: c.leaf.set(i=n, s=str(n)),
    lambda c, n: c.leaves[n % 2].set(f=float(n)),
    lambda c, n: c.leaves[n % 2].ints.__setitem__(0, n),
    lambda c, n: c.leaves.append(Leaf(i=n)),
    lambda c, n: c.set_recursively("table['x y']", float(n)),
    lambda c, n: c.table.__setitem__("new", float(n)),
    lambda c, n: c.set_recursively("leaves[1].pair[0]", n),
    lambda c, n: c.set(name=f"name{n}"),
    lambda c, n: c.leaf.set(pair=(n, "p"), color=Color.GREEN),
]
mutations = st.lists(st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 99)), max_size=8)


@given(roots, mutations)
def test_mutating_a_clone_never_changes_the_original(cfg, steps):
    before = to_flat_text(cfg)
    clone = cfg.clone()
    assert to_flat_text(clone) == before
    for mutate, n in steps:
        mutate(clone, n)
    assert to_flat_text(cfg) == before


@given(roots, mutations)
def test_mutating_the_original_never_changes_a_clone_or_a_config_it_was_set_into(cfg, steps):
    clone = cfg.clone()
    holder = Root(leaf=cfg.leaf, leaves=cfg.leaves)
    clone_text, holder_text = to_flat_text(clone), to_flat_text(holder)
    for mutate, n in steps:
        mutate(cfg, n)
    assert to_flat_text(clone) == clone_text
    assert to_flat_text(holder) == holder_text


# ---- flat form round trips --------------------------------------------------------------


@given(roots)
def test_flat_form_survives_a_round_trip_through_overrides(cfg):
    flat = to_flat_dict(cfg)
    fresh = apply_overrides(Root(), [f"{path}={value}" for path, value in flat.items()])
    assert to_flat_text(fresh) == to_flat_text(cfg)
    assert to_flat_text(cfg.clone()) == to_flat_text(cfg)


@given(roots)
def test_flat_text_lines_are_sorted_and_unique(cfg):
    paths = [line.split(": ", 1)[0] for line in to_flat_text(cfg).splitlines()]
    assert paths == sorted(paths, key=path_sort_key)
    assert len(set(paths)) == len(paths)


# ---- traversal --------------------------------------------------------------------------


class Holder(ConfigBase):
    tree: Any = None
    n: int = 0


@dataclasses.dataclass
class Span:
    start: Any = 0
    stop: Any = None


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=4)
)
keys = st.one_of(st.text(alphabet="ab xy=", min_size=1, max_size=3), st.integers(-2, 5))


def _extend(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=4),
        st.builds(Holder, tree=children, n=st.integers()),
        st.builds(Span, start=children, stop=children),
    )


trees = st.builds(Holder, tree=st.recursive(scalars, _extend, max_leaves=25))


def _count_leaves(value: Any) -> int:
    """An independent count: non-containers and empty containers are leaves."""
    if isinstance(value, ConfigBase):
        kids = [getattr(value, name) for name in value.keys()]
    elif isinstance(value, (list, tuple)):
        kids = list(value)
    elif isinstance(value, dict):
        kids = list(value.values())
    elif dataclasses.is_dataclass(value):
        kids = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return 1
    return sum(_count_leaves(kid) for kid in kids) if kids else 1


@given(trees)
def test_traversal_reaches_every_leaf_exactly_once(cfg):
    found = leaves(cfg)
    paths = [path for path, _ in found]
    assert len(found) == _count_leaves(cfg)
    assert len(set(paths)) == len(paths)
    for path, value in found:
        assert cfg.get_recursively(path) is value
    assert len(to_flat_dict(cfg)) == len(leaves(cfg, literal_sequences=True))


@given(trees)
def test_visit_enters_and_exits_every_node_once(cfg):
    entered: list[str] = []
    exited: list[str] = []
    visit(cfg, lambda p, v: entered.append(p), lambda p, v: exited.append(p))
    assert sorted(entered) == sorted(exited)
    assert len(set(entered)) == len(entered)
    assert exited[-1] == "" and entered[0] == ""
