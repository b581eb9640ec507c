"""`from_flat_text`: configs rebuilt from their flat text, the import allowlist, and errors
that name the line."""

import enum
import math
import re
import sys
from typing import Any, Callable, Optional

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.config import (
    REQUIRED,
    ConfigBase,
    Configurable,
    FlatTextError,
    InstantiableConfig,
    config_for_function,
    from_flat_text,
    to_flat_text,
)

HERE = (__name__ + ".",)
ALLOW = ("jaxlearn.", "math.", "builtins.", *HERE)


class Mode(enum.Enum):
    FAST = 1
    SLOW = 2


class Shape(ConfigBase):  # A plain (non-instantiable) sub-config: no klass line.
    dims: tuple[int, ...] = (1, 2)
    name: str = "s"


class Leaf(Configurable):
    class Config(Configurable.Config):
        width: int = 4
        rate: float = 0.5
        label: str = REQUIRED
        mode: Mode = Mode.FAST
        act: Callable[..., Any] = math.tanh
        shape: Optional[Shape] = None


class Other(Configurable):
    class Config(Configurable.Config):
        depth: int = 1
        table: dict[str, float] = {}


def scale(x: float, factor: float = 2.0) -> float:
    return x * factor


class Node(Configurable):
    class Config(Configurable.Config):
        child: InstantiableConfig = Leaf.default_config()
        stages: list[InstantiableConfig] = []
        pairs: tuple[tuple[str, Any], ...] = ()
        extra: Optional[InstantiableConfig] = None
        fn_cfg: Optional[InstantiableConfig] = None
        sizes: list[int] = [1, 2, 3]


texts = st.text(alphabet="abc xyz'\"\\:=\n", max_size=6)
leaves = st.builds(
    lambda w, r, lab, m, a, dims: Leaf.default_config().set(
        width=w, rate=r, label=lab, mode=m, act=a,
        shape=None if dims is None else Shape(dims=dims, name=lab if lab is not REQUIRED else "")),
    st.integers(-10**6, 10**6), st.floats(allow_nan=True), st.one_of(st.just(REQUIRED), texts),
    st.sampled_from(Mode), st.sampled_from([math.sin, math.floor, abs, len]),
    st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(0, 9))),
)
others = st.builds(lambda d, t: Other.default_config().set(depth=d, table=t),
                   st.integers(0, 5), st.dictionaries(st.sampled_from(["a", "b_c", "x y"]),
                                                      st.floats(allow_nan=False), max_size=3))
parts = st.one_of(leaves, others)
nodes = st.builds(
    lambda child, stages, pairs, extra, factor, sizes: Node.default_config().set(
        child=child, stages=stages, pairs=tuple(pairs), extra=extra, sizes=sizes,
        fn_cfg=None if factor is None else config_for_function(scale, factor=factor)),
    parts, st.lists(parts, max_size=3), st.lists(st.tuples(texts, parts), max_size=2),
    st.one_of(st.none(), parts), st.one_of(st.none(), st.floats(-5, 5)),
    st.lists(st.integers(), max_size=4),
)


@given(nodes)
def test_generated_trees_round_trip(cfg):
    text = to_flat_text(cfg)
    rebuilt = from_flat_text(text, importable=ALLOW)
    assert to_flat_text(rebuilt) == text
    assert type(rebuilt) is type(cfg)


def test_rebuilt_config_instantiates_and_computes():
    cfg = config_for_function(scale, x=3.0, factor=0.5)
    rebuilt = from_flat_text(to_flat_text(cfg), importable=ALLOW)
    assert rebuilt.instantiate() == 1.5
    leaf = from_flat_text("act: math.sqrt\nklass: %sLeaf\nlabel: 'q'\nmode: %sMode.SLOW\n"
                          "rate: 0.5\nshape: None\nwidth: 9\n" % (HERE[0], HERE[0]),
                          importable=ALLOW)
    assert leaf.width == 9 and leaf.mode is Mode.SLOW and leaf.act(16.0) == 4.0
    assert isinstance(leaf.instantiate(), Leaf)


@pytest.mark.parametrize("text, line, message", [
    ("klass: %sNode\nchild.klass: %sOther\nchild.dept: 2\n" % (HERE[0], HERE[0]), 3,
     "Other.Config has no field 'dept'"),
    ("klass: %sNode\nchild.klass: %sMissing\n" % (HERE[0], HERE[0]), 2, "cannot import"),
    ("klass: %sNode\nsizes: 'x'\n" % HERE[0], 2, "sizes"),
    ("klass: %sNode\nstages[1].klass: %sOther\n" % (HERE[0], HERE[0]), 2, "missing"),
    ("klass: %sNode\nsizes [1]\n" % HERE[0], 2, "expected 'path: value'"),
    ("klass: %sNode\nsizes: [1]\nsizes: [2]\n" % HERE[0], 3, "repeats line 2"),
    ("klass: %sNode\nextra.width: 3\n" % HERE[0], 2, "needs its 'klass:' line"),
])
def test_errors_name_the_line(text, line, message):
    with pytest.raises(FlatTextError, match=message) as e:
        from_flat_text(text, importable=ALLOW, where="run.txt")
    assert re.search(rf"run\.txt line {line}\b", str(e.value)), e.value


def test_root_without_klass_is_refused():
    with pytest.raises(FlatTextError, match="no root 'klass:' or 'fn:' line"):
        from_flat_text("width: 3\n", importable=ALLOW)


@pytest.mark.parametrize("target", ["http.server.HTTPServer", "os.system",
                                    "subprocess.Popen"])
def test_modules_outside_the_allowlist_are_never_imported(target):
    module = target.rpartition(".")[0]
    was_loaded = module in sys.modules
    with pytest.raises(FlatTextError, match="outside the importable modules") as e:
        from_flat_text(f"klass: {target}\n", where="evil.txt")
    assert "evil.txt line 1" in str(e.value)
    assert (module in sys.modules) == was_loaded


def test_objects_reached_through_an_allowed_module_are_refused():
    # jaxlearn.config.overrides imports importlib; the path is under jaxlearn., the object
    # is not defined there.
    with pytest.raises(FlatTextError, match="defined in 'importlib'"):
        from_flat_text("fn: jaxlearn.config.overrides.importlib.import_module\nname: 'os'\n")
    with pytest.raises(FlatTextError, match="outside the importable modules"):
        from_flat_text(f"klass: {HERE[0]}Node\nextra.klass: os.system\n", importable=ALLOW)


def test_default_allowlist_refuses_this_test_module():
    with pytest.raises(FlatTextError, match="outside the importable modules"):
        from_flat_text(to_flat_text(Node.default_config()))
