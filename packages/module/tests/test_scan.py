"""scan_child: stacked layers under lax.scan equal a Python loop and trace one layer."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from module_toys import Block, Stack, block_config, max_abs_diff

from jaxlearn.module import (
    Module,
    ModuleError,
    RematSpec,
    child_key,
    functional,
    scan_child,
    stable_hash,
)


class Scanned(Module):
    """`num_layers` Blocks with stacked parameters, run by scan_child."""

    class Config(Module.Config):
        num_layers: int = 2
        block: Block.Config = Block.default_config()

    def __init__(self, cfg: "Scanned.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._add_stacked_child("layer", self.config.block, num_layers=self.config.num_layers)

    def forward(self, x: jax.Array) -> tuple[jax.Array, Any]:
        def one_layer(layer: Module, h: jax.Array, _: Any) -> tuple[jax.Array, jax.Array]:
            out = layer(h)
            return out, jnp.mean(out)

        y, means = scan_child(self, self.layer, one_layer, x)
        return y, means


def scanned(n: int, **block: Any) -> Scanned:
    cfg = Scanned.default_config().set(name="m", num_layers=n, block=block_config(8, 16, **block))
    return cfg.instantiate()


def looped(n: int) -> Stack:
    cfg = Stack.default_config().set(name="m", num_layers=n, block=block_config(8, 16))
    return cfg.instantiate()


def unstack(params: Any, n: int) -> Any:
    return {f"layer{i}": jax.tree.map(lambda p: p[i], params["layer"]) for i in range(n)}


def test_stacked_specs_and_init() -> None:
    model = scanned(3)
    specs = model.create_parameter_specs_recursively()
    weight = specs["layer"]["up"]["weight"]
    assert weight.shape == (3, 8, 16) and weight.mesh_axes == ("layers", "embed", "mlp")
    assert weight.fan_axes is not None and weight.fan_axes.batch_axis == (0,)
    key = jax.random.key(0)
    params = model.initialize_parameters_recursively(key)
    assert params["layer"]["up"]["weight"].shape == (3, 8, 16)
    block = model.layer
    keys = jax.random.split(jax.random.fold_in(key, stable_hash("layer")), 3)
    for i in range(3):
        expected = block.initialize_parameters_recursively(keys[i])
        got = jax.tree.map(lambda p: p[i], params["layer"])
        assert max_abs_diff(got, expected) < 1e-6
    assert max_abs_diff(params["layer"]["up"]["weight"][0], params["layer"]["up"]["weight"][1]) > 0


@pytest.mark.parametrize("remat", [None, "nothing_saveable"])
def test_scan_equals_python_loop(remat: Optional[str]) -> None:
    n = 3
    model = scanned(n)
    if remat:
        cfg = model.config.clone()
        cfg.block.remat_spec = RematSpec(policy=remat)
        model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    reference = looped(n)
    ref_params = unstack(params, n)

    def scan_loss(p: Any) -> jax.Array:
        return jnp.sum(functional(model, jax.random.key(2), p, (x,))[0][0] ** 2)

    def loop_loss(p: Any) -> jax.Array:
        return jnp.sum(functional(reference, jax.random.key(2), p, (x,))[0] ** 2)

    (ls, gs), (ll, gl) = jax.jit(jax.value_and_grad(scan_loss))(params), jax.jit(
        jax.value_and_grad(loop_loss)
    )(ref_params)
    assert abs(float(ls - ll)) < 1e-5 * abs(float(ll))
    assert max_abs_diff(unstack(gs, n), gl) < 1e-5


def dot_count(jaxpr: Any) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += dot_count(sub)
    return count


def test_compiles_one_layer() -> None:
    x = jnp.ones((4, 8))
    counts = {}
    for n in (1, 4):
        model = scanned(n)
        params = model.initialize_parameters_recursively(jax.random.key(0))
        jaxpr = jax.make_jaxpr(lambda p: functional(model, None, p, (x,))[0])(params)
        assert [e.primitive.name for e in jaxpr.jaxpr.eqns].count("scan") == 1
        counts[n] = dot_count(jaxpr.jaxpr)
    assert counts[1] == counts[4] == 2  # up and down of a single traced layer.


def test_outputs_come_back_stacked() -> None:
    class WithAux(Scanned):
        def forward(self, x: jax.Array) -> tuple[jax.Array, Any]:
            y, _ = super().forward(x)
            return y, dict(self.get_module_outputs("aux_loss"))

    cfg = WithAux.default_config().set(name="m", num_layers=3, block=block_config(8, 16))
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    x = jnp.ones((4, 8))
    (_, aux), oc = jax.jit(lambda p: functional(model, None, p, (x,)))(params)
    assert list(aux) == ["layer.aux_loss"]
    assert aux["layer.aux_loss"].shape == (3,)
    assert oc.summaries["layer"]["up"]["mean"].shape == (3,)
    np.testing.assert_allclose(oc.summaries["layer"]["up"]["mean"][0], 1.0)


class KeyScan(Module):
    """Scans a stateless child and returns each iteration's key data."""

    class Config(Module.Config):
        scans: int = 1

    def __init__(self, cfg: "KeyScan.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._add_child("probe", Block.default_config().set(dim=1, hidden_dim=1))

    def forward(self) -> list[jax.Array]:
        def fn(child: Module, carry: Any, _: Any) -> tuple[Any, jax.Array]:
            return carry, jax.random.key_data(child.prng_key)

        out = []
        for i in range(self.config.scans):
            label = "" if i == 0 else f"again{i}"
            out.append(scan_child(self, self.probe, fn, 0, num_iterations=3, label=label)[1])
        return out


def test_scan_keys_and_repeated_scans() -> None:
    key = jax.random.key(7)
    model = KeyScan.default_config().set(name="k", scans=2).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    params["probe"] = jax.tree.map(lambda p: jnp.stack([p] * 3), params["probe"])
    first, second = functional(model, key, params, ())[0]
    base = child_key(key, "probe", "scan")
    np.testing.assert_array_equal(first, jax.random.key_data(jax.random.split(base, 3)))
    assert len({tuple(np.ravel(k)) for k in first}) == 3
    assert not np.array_equal(first, second)


def test_scan_misuse_errors() -> None:
    class Repeat(KeyScan):
        def forward(self) -> Any:
            def fn(child: Module, carry: Any, _: Any) -> tuple[Any, Any]:
                return carry, None

            scan_child(self, self.probe, fn, 0, num_iterations=2)
            return scan_child(self, self.probe, fn, 0, num_iterations=2)

    model = Repeat.default_config().set(name="r").instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    with pytest.raises(ModuleError, match=r"r.probe: scan_child needs state stacked \[2, ...\]"):
        functional(model, None, params, ())
    params["probe"] = jax.tree.map(lambda p: jnp.stack([p] * 2), params["probe"])
    with pytest.raises(ModuleError, match="r: scan_child over 'probe' was already run"):
        functional(model, None, params, ())

    class Orphan(Module):
        def forward(self) -> Any:
            return scan_child(self, scanned(2).layer, lambda c, h, _: (h, None), 0)

    with pytest.raises(ModuleError, match="must be called from its parent's call"):
        functional(Orphan.default_config().set(name="o").instantiate(), None, {}, ())
