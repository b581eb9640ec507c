"""Invocation contexts: nesting, key derivation, output collection paths, misuse errors."""

from __future__ import annotations

import zlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from module_toys import Block, Stack, block_config

from jaxlearn.config import REQUIRED
from jaxlearn.module import (
    Module,
    ModuleError,
    ParameterSpec,
    child_key,
    current_context,
    functional,
    iter_collection,
    scan_child,
    side_input,
    stable_hash,
    zeros,
)

NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)


def key_data(key: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))


class Probe(Module):
    """Returns the data of its context key; records its context path."""

    def forward(self) -> np.ndarray:
        ctx = current_context()
        assert ctx is not None
        self.add_summary("path", ctx.path())
        return key_data(self.prng_key)

    def other(self) -> np.ndarray:
        return key_data(self.prng_key)


class Fan(Module):
    """Children named by config; calls them in config order (or reversed)."""

    class Config(Module.Config):
        names: list[str] = REQUIRED
        reverse: bool = False

    def __init__(self, cfg: "Fan.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        for name in self.config.names:
            self._add_child(name, Probe.default_config())

    def forward(self) -> dict[str, jax.Array]:
        names = list(self.config.names)
        order = reversed(names) if self.config.reverse else names
        return {name: getattr(self, name)() for name in order}


def fan(names: list[str], reverse: bool = False) -> Fan:
    return Fan.default_config().set(name="root", names=names, reverse=reverse).instantiate()


def expected_child_key(parent: jax.Array, name: str) -> np.ndarray:
    return key_data(jax.random.fold_in(parent, zlib.crc32(name.encode()) & 0x7FFFFFFF))


@given(names=st.lists(NAMES, min_size=1, max_size=5, unique=True), seed=st.integers(0, 2**31 - 1))
def test_child_keys_follow_the_documented_derivation(names: list[str], seed: int) -> None:
    key = jax.random.key(seed)
    keys, oc = functional(fan(names), key, {}, ())
    for name in names:
        np.testing.assert_array_equal(keys[name], expected_child_key(key, name))
        assert oc.summaries[name]["path"] == f"root.{name}"
    # Deterministic, and independent of the order in which siblings are called.
    again, _ = functional(fan(names, reverse=True), key, {}, ())
    jax.tree.map(np.testing.assert_array_equal, keys, again)
    # Distinct names give distinct keys.
    assert len({tuple(np.ravel(k)) for k in keys.values()}) == len(names)


@given(name=NAMES, other=NAMES)
def test_child_streams_are_independent(name: str, other: str) -> None:
    if name == other:
        return
    key = jax.random.key(0)
    a = jax.random.normal(jax.random.fold_in(key, stable_hash(name)), (4096,))
    b = jax.random.normal(jax.random.fold_in(key, stable_hash(other)), (4096,))
    parent = jax.random.normal(key, (4096,))
    for x, y in ((a, b), (a, parent)):
        assert abs(float(jnp.corrcoef(x, y)[0, 1])) < 0.1


def test_stable_hash_is_crc32() -> None:
    assert stable_hash("layer0") == zlib.crc32(b"layer0") & 0x7FFFFFFF
    assert 0 <= stable_hash("x" * 100) < 2**31


def test_child_key_helper() -> None:
    key = jax.random.key(5)
    k = child_key(key, "a", "forward", "")
    np.testing.assert_array_equal(key_data(k), expected_child_key(key, "a"))
    assert child_key(None, "a") is None
    variants = [child_key(key, "a", m, lab) for m in ("forward", "other") for lab in ("", "x")]
    assert len({tuple(key_data(v).ravel()) for v in variants}) == 4


class Twice(Module):
    """Calls its probe child twice, the second time as configured."""

    class Config(Module.Config):
        second: str = "plain"  # plain | label | other_method

    def __init__(self, cfg: "Twice.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._add_child("probe", Probe.default_config())

    def forward(self) -> tuple[jax.Array, jax.Array]:
        first = self.probe()
        second = self.config.second
        if second == "plain":
            return first, self.probe()
        if second == "label":
            return first, self.invoke_child("probe", label="again")
        return first, self.probe.other()


def twice(second: str) -> Twice:
    return Twice.default_config().set(name="t", second=second).instantiate()


def test_calling_a_child_twice_raises() -> None:
    with pytest.raises(ModuleError, match="t: child 'probe' method 'forward' was already called"):
        functional(twice("plain"), jax.random.key(0), {}, ())


def test_invoke_child_with_label() -> None:
    key = jax.random.key(0)
    (first, second), oc = functional(twice("label"), key, {}, ())
    np.testing.assert_array_equal(first, expected_child_key(key, "probe"))
    folded = jax.random.fold_in(jax.random.fold_in(key, stable_hash("probe")), stable_hash("again"))
    np.testing.assert_array_equal(second, key_data(folded))
    # Each call records under its own entry, so outputs never collide.
    assert oc.summaries["probe"]["path"] == "t.probe"
    assert oc.summaries["probe@again"]["path"] == "t.probe@again"


def test_other_method_gets_its_own_key() -> None:
    key = jax.random.key(0)
    (first, second), _ = functional(twice("other_method"), key, {}, ())
    child = jax.random.fold_in(key, stable_hash("probe"))
    np.testing.assert_array_equal(first, key_data(child))
    np.testing.assert_array_equal(second, key_data(jax.random.fold_in(child, stable_hash("other"))))


def test_invoke_child_errors() -> None:
    class Caller(Twice):
        def forward(self) -> Any:
            return self.invoke_child(self.config.second, label="")

    for target, match in (("nope", "no child 'nope'"), ("probe", "needs a non-empty label")):
        model = Caller.default_config().set(name="c", second=target).instantiate()
        with pytest.raises(ModuleError, match=match):
            functional(model, jax.random.key(0), {}, ())


class Nest(Module):
    """Holds a Fan child, so probes run two levels down."""

    def __init__(self, cfg: Module.Config, *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._add_child("mid", Fan.default_config().set(names=["a", "b"]))

    def forward(self) -> Any:
        outer = current_context()
        inner = self.mid()
        assert current_context() is outer  # Popped back after the child call.
        return inner


def test_context_stack_nesting_and_unwinding() -> None:
    model = Nest.default_config().set(name="outer").instantiate()
    key = jax.random.key(1)
    keys, oc = functional(model, key, {}, ())
    assert oc.summaries["mid"]["a"]["path"] == "outer.mid.a"
    assert oc.summaries["mid"]["b"]["path"] == "outer.mid.b"
    mid = jax.random.fold_in(key, stable_hash("mid"))
    np.testing.assert_array_equal(keys["b"], expected_child_key(mid, "b"))
    assert current_context() is None


def test_context_unwinds_after_an_error() -> None:
    class Boom(Module):
        def forward(self) -> None:
            raise RuntimeError("boom")

    model = Boom.default_config().set(name="b").instantiate()
    with pytest.raises(RuntimeError, match="boom"):
        functional(model, None, {}, ())
    assert current_context() is None


def test_calls_outside_a_context_raise() -> None:
    model = Block.default_config().set(name="b", dim=4, hidden_dim=4).instantiate()
    with pytest.raises(ModuleError, match="b.forward called outside an invocation context"):
        model(jnp.ones((1, 4)))
    with pytest.raises(ModuleError, match="b: context accessed outside this module's own call"):
        model.parameters  # noqa: B018


def test_only_the_parent_may_call_a_child() -> None:
    class Grab(Module):
        """Calls its grandchild directly: not allowed."""

        def __init__(self, cfg: Module.Config, *, parent: Optional[Module] = None):
            super().__init__(cfg, parent=parent)
            self._add_child("block", block_config(dim=4, hidden_dim=4))

        def forward(self, x: jax.Array) -> jax.Array:
            return self.block.up(x)

    model = Grab.default_config().set(name="g").instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    with pytest.raises(ModuleError, match="g.block.up.forward called from the context of g"):
        functional(model, None, params, (jnp.ones((1, 4)),))


def test_prng_key_required_when_drawn() -> None:
    model = Twice.default_config().set(name="t", second="label").instantiate()
    with pytest.raises(ModuleError, match="t.probe: no PRNG key was given"):
        functional(model, None, {}, ())


def test_output_collection_paths_and_aux_outputs() -> None:
    class Model(Stack):
        def forward(self, x: jax.Array) -> tuple[jax.Array, Any]:  # type: ignore[override]
            y = super().forward(x)
            aux = self.get_module_outputs("aux_loss")
            self.add_module_output("total_aux", sum(v for _, v in aux))
            return y, aux

    cfg = Model.default_config().set(name="m", num_layers=2, block=block_config(4, 8))
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    x = jnp.ones((2, 4))
    (_, aux), oc = functional(model, None, params, (x,))
    assert [path for path, _ in aux] == ["layer0.aux_loss", "layer1.aux_loss"]
    found = dict(iter_collection(oc.module_outputs, "aux_loss"))
    assert list(found) == ["layer0.aux_loss", "layer1.aux_loss"]
    np.testing.assert_allclose(oc.module_outputs["total_aux"], sum(found.values()), rtol=1e-6)
    assert set(oc.summaries["layer1"]["down"]) == {"mean"}
    np.testing.assert_allclose(oc.summaries["layer0"]["up"]["mean"], 1.0)


def test_output_twice_or_clashing_with_child_raises() -> None:
    class Noisy(Block):
        class Config(Block.Config):
            clash: str = "twice"

        def forward(self, x: jax.Array) -> jax.Array:
            if self.config.clash == "twice":
                self.add_summary("s", x.sum())
                self.add_summary("s", x.sum())
            elif self.config.clash == "after_child":
                x = super().forward(x)
                self.add_summary("up", x.sum())
            else:
                self.add_summary("up", x.sum())
                x = super().forward(x)
            return x

    base = Noisy.default_config().set(name="n", dim=4, hidden_dim=4)
    params = base.instantiate().initialize_parameters_recursively(jax.random.key(0))
    cases = {
        "twice": "n: summaries 's' recorded twice",
        "after_child": "n: summaries 'up' recorded twice .*child's outputs",
        "before_child": "n: child 'up' clashes with the summaries entry 'up'",
    }
    for clash, match in cases.items():
        model = base.clone(clash=clash).instantiate()
        with pytest.raises(ModuleError, match=match):
            functional(model, None, params, (jnp.ones((1, 4)),))


def test_state_updates_and_merge() -> None:
    from jaxlearn.module import merge_state_updates

    class Counter(Module):
        def _create_layer_parameter_specs(self) -> dict:
            from jaxlearn.module import ParameterSpec, zeros

            return {"count": ParameterSpec((), (), initializer=zeros())}

        def forward(self) -> None:
            self.add_state_update("count", self.state["count"] + 1)
            self.add_state_update("not_state", jnp.ones(()))

    class Outer(Module):
        def __init__(self, cfg: Module.Config, *, parent: Optional[Module] = None):
            super().__init__(cfg, parent=parent)
            self._add_child("counter", Counter.default_config())
            self._add_child("idle", Counter.default_config())

        def forward(self) -> None:
            self.counter()

    model = Outer.default_config().set(name="o").instantiate()
    state = model.initialize_parameters_recursively(jax.random.key(0))
    for _ in range(3):
        _, oc = jax.jit(lambda s: functional(model, None, s, ()))(state)
        state = merge_state_updates(state, oc.state_updates)
    assert float(state["counter"]["count"]) == 3.0 and float(state["idle"]["count"]) == 0.0
    assert "not_state" not in state["counter"]


class SideScaled(Module):
    """x * the side input "scale" (1 when the call has none)."""

    def _create_layer_parameter_specs(self) -> dict[str, Any]:
        return {"w": ParameterSpec((), (), initializer=zeros())}

    def forward(self, x: jax.Array) -> jax.Array:
        return x * side_input("scale", 1.0) + self.parameters["w"]


class SideParent(Module):
    """Scans a stacked SideScaled child three times over x."""

    def __init__(self, cfg: Module.Config, *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._add_stacked_child("inner", SideScaled.default_config(), 3)

    def forward(self, x: jax.Array) -> jax.Array:
        x, _ = scan_child(self, self.inner, lambda m, c, _: (m(c), None), x)
        return x


def test_side_inputs_reach_scanned_children_under_jit() -> None:
    model = SideParent.default_config().set(name="p").instantiate()
    state = {"inner": {"w": jnp.zeros(3)}}
    x = jnp.ones(2)

    @jax.jit
    def call(scale: jax.Array) -> jax.Array:
        return functional(model, None, state, (x,), side_inputs={"scale": scale})[0]

    np.testing.assert_allclose(call(jnp.array([2.0, 3.0])), [8.0, 27.0])
    np.testing.assert_allclose(functional(model, None, state, (x,))[0], [1.0, 1.0])
    assert side_input("scale", "none") == "none"  # Outside any call.
