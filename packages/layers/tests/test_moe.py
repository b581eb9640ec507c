"""MixtureOfExperts: numpy references (dense FFN, per-token top-k, capacity drops), aux
losses, HF Mixtral parity, quantized dots, expert-sharded execution."""

import math
import os
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, PartitionSpec

from jaxlearn.layers.ffn import FeedForward
from jaxlearn.layers.moe import MixtureOfExperts, MoEConfigError, expert_capacity
from jaxlearn.layers.quantized import Int8Dot
from jaxlearn.module import FanAxes, functional, logical_sharding, parameter_shardings

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "mixtral_moe_fixture.npz")


def _cfg(**kw: Any) -> Any:
    base = dict(name="moe", input_dim=8, hidden_dim=12, num_experts=4, num_experts_per_token=2)
    base.update(kw)
    return MixtureOfExperts.default_config().set(**base)


def _init(cfg: Any, seed: int = 0) -> tuple:
    moe = cfg.instantiate()
    params = moe.initialize_parameters_recursively(jax.random.key(seed))
    # Larger router weights than the default init so routing is decisive and varied.
    params["router"] = params["router"] * 3.0
    return moe, params


_JITTED: dict = {}


def _run(moe: Any, params: Any, x: Any) -> tuple:
    """(y, output collection) of a jitted forward (one compile per module and shape)."""
    if moe not in _JITTED:
        _JITTED[moe] = jax.jit(lambda p, x: functional(moe, None, p, (x,)))
    return _JITTED[moe](params, x)


# ---- numpy reference ---------------------------------------------------------------------

_NP_ACT = {
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "linear": lambda x: x,
    "relu": lambda x: np.maximum(x, 0.0),
}


def _np_expert(p: dict, e: int, v: np.ndarray, activation: tuple) -> np.ndarray:
    f = lambda n: np.asarray(p[n][e], np.float64)  # noqa: E731
    if len(activation) == 2:
        h = _NP_ACT[activation[0]](v @ f("wi_0")) * _NP_ACT[activation[1]](v @ f("wi_1"))
    else:
        h = _NP_ACT[activation[0]](v @ f("wi"))
    return h @ f("wo")


def np_moe(
    x: Any,
    p: dict,
    k: int,
    *,
    scores: str = "softmax",
    normalize: bool = True,
    capacity: Optional[int] = None,
    activation: tuple = ("silu", "linear"),
) -> tuple[np.ndarray, float]:
    """Per-token loop. Capacity: per sequence, first choices (in order) before second ones.
    Returns (y, fraction of dropped assignments)."""
    x = np.asarray(x, np.float64)
    b, s, _ = x.shape
    router = np.asarray(p["router"], np.float64)
    y = np.zeros_like(x)
    dropped = 0
    for g in range(b):
        logits = x[g] @ router  # [S, E]
        if scores == "softmax":
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
        else:
            probs = 1.0 / (1.0 + np.exp(-logits))
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(probs, top, -1)
        if normalize:
            w = w / w.sum(-1, keepdims=True)
        load = np.zeros(router.shape[1], int)
        for j in range(k):
            for t in range(s):
                e = top[t, j]
                if capacity is not None and load[e] >= capacity:
                    dropped += 1
                    continue
                load[e] += 1
                y[g, t] += w[t, j] * _np_expert(p, e, x[g, t], activation)
    return y, dropped / (b * s * k)


def _x(shape: tuple, seed: int = 1) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape)


# ---- equivalences ------------------------------------------------------------------------


def test_parameter_specs() -> None:
    moe = _cfg().instantiate()
    specs = moe.create_parameter_specs_recursively()
    assert specs["router"].mesh_axes == ("embed", "expert") and specs["router"].shape == (8, 4)
    for n in ("wi_0", "wi_1"):
        assert specs[n].mesh_axes == ("expert", "embed", "mlp") and specs[n].shape == (4, 8, 12)
        assert specs[n].fan_axes == FanAxes((-2,), (-1,), (0,))
    assert specs["wo"].mesh_axes == ("expert", "mlp", "embed") and specs["wo"].shape == (4, 12, 8)
    plain = _cfg(activation=("relu",)).instantiate().create_parameter_specs_recursively()
    assert sorted(plain) == ["router", "wi", "wo"]
    # Variance scaling per expert: fan_in = embed, not expert * embed.
    params = moe.initialize_parameters_recursively(jax.random.key(0))
    assert abs(float(jnp.std(params["wi_0"])) * math.sqrt(8) - 1.0) < 0.2


def test_one_expert_with_full_capacity_equals_dense_ffn() -> None:
    cfg = _cfg(num_experts=1, num_experts_per_token=1, capacity_factor=1.0)
    moe, p = _init(cfg)
    x = _x((2, 6, 8))
    y, oc = _run(moe, p, x)
    # Dense gated FFN in numpy: (silu(x wi_0) * (x wi_1)) wo.
    xn = np.asarray(x, np.float64)
    f = lambda n: np.asarray(p[n][0], np.float64)  # noqa: E731
    h = xn @ f("wi_0")
    ref = ((h / (1 + np.exp(-h))) * (xn @ f("wi_1"))) @ f("wo")
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert float(oc.summaries["dropped_fraction"]) == 0.0
    # ... and the FeedForward layer with the same weights (drop-in replacement).
    ffn = FeedForward.default_config().set(name="ffn", input_dim=8, hidden_dim=12).instantiate()
    y_ffn, _ = functional(ffn, None, {n: {"weight": p[n][0]} for n in ("wi_0", "wi_1", "wo")}, (x,))
    np.testing.assert_allclose(y, y_ffn, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(dropless_method="ragged_dot"),
        dict(dropless_method="dense"),
        dict(capacity_factor=4.0),  # capacity >= tokens: nothing dropped
    ],
    ids=["ragged_dot", "dense", "capacity"],
)
def test_top2_of_4_equals_numpy_reference(kw: dict) -> None:
    moe, p = _init(_cfg(**kw))
    x = _x((2, 9, 8))
    y, oc = _run(moe, p, x)
    ref, _ = np_moe(x, p, 2)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert float(oc.summaries["dropped_fraction"]) == 0.0


@pytest.mark.parametrize("scores,normalize", [("sigmoid", True), ("softmax", False)])
def test_router_variants_equal_numpy_reference(scores: str, normalize: bool) -> None:
    cfg = _cfg(router_scores=scores, normalize_top_k_weights=normalize, num_experts_per_token=3)
    moe, p = _init(cfg)
    x = _x((1, 7, 8))
    y, _ = _run(moe, p, x)
    ref, _ = np_moe(x, p, 3, scores=scores, normalize=normalize)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_gradients_agree_across_dispatch_methods() -> None:
    x = _x((2, 5, 8))
    grads = []
    for kw in (
        dict(dropless_method="ragged_dot"),
        dict(dropless_method="dense"),
        dict(capacity_factor=4.0),
    ):
        moe, p = _init(_cfg(**kw))

        def loss(p: Any, x: Any) -> jax.Array:
            y, oc = _run(moe, p, x)
            return jnp.sum(y**2) + oc.module_outputs["aux_loss"]

        grads.append(jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x))
    for other in grads[1:]:
        for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(other)):
            assert np.all(np.isfinite(a))
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# ---- capacity and dropped tokens ---------------------------------------------------------


def _skewed_params(cfg: Any) -> tuple:
    """Every token (with positive inputs) ranks expert 0 first, then 1, 2, ..."""
    moe, p = _init(cfg)
    e = cfg.num_experts
    p["router"] = jnp.tile(jnp.linspace(1.0, -1.0, e)[None], (cfg.input_dim, 1))
    return moe, p


def test_capacity_drops_expected_tokens_top1() -> None:
    # 8 tokens, 4 experts, top-1, factor 1 -> capacity 2; all tokens want expert 0.
    cfg = _cfg(num_experts_per_token=1, capacity_factor=1.0)
    assert expert_capacity(1.0, 8, 1, 4) == 2
    moe, p = _skewed_params(cfg)
    x = jnp.abs(_x((1, 8, 8))) + 0.1
    y, oc = _run(moe, p, x)
    assert float(oc.summaries["dropped_fraction"]) == pytest.approx(6 / 8)
    ref, dropped = np_moe(x, p, 1, capacity=2)
    assert dropped == pytest.approx(6 / 8)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    # The first two tokens got expert 0; the others were dropped (zero output).
    assert np.all(np.asarray(y[0, 2:]) == 0) and np.all(np.abs(np.asarray(y[0, :2])) > 0)


def test_capacity_priority_first_choices_before_second() -> None:
    # top-2 of 4, 4 tokens per sequence, factor 1 -> capacity 2; choices are (0, 1) for all.
    cfg = _cfg(num_experts_per_token=2, capacity_factor=1.0)
    assert expert_capacity(1.0, 4, 2, 4) == 2
    moe, p = _skewed_params(cfg)
    x = jnp.abs(_x((2, 4, 8))) + 0.1
    y, oc = _run(moe, p, x)
    ref, dropped = np_moe(x, p, 2, capacity=2)
    # Per sequence: expert 0 keeps tokens 0, 1 (first choices); expert 1 keeps 0, 1 too.
    assert dropped == pytest.approx(4 / 8)
    assert float(oc.summaries["dropped_fraction"]) == pytest.approx(4 / 8)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=12)
@given(
    seq=st.integers(1, 6),
    experts=st.integers(2, 5),
    data=st.data(),
)
def test_capacity_path_matches_numpy_reference(seq: int, experts: int, data: Any) -> None:
    k = data.draw(st.integers(1, experts), label="k")
    factor = data.draw(st.sampled_from([0.25, 0.5, 1.0, 1.5]), label="capacity_factor")
    seed = data.draw(st.integers(0, 3), label="seed")
    moe, p = _init(_cfg(num_experts=experts, num_experts_per_token=k, capacity_factor=factor), seed)
    x = _x((2, seq, 8), seed + 10)
    y, oc = _run(moe, p, x)
    ref, dropped = np_moe(x, p, k, capacity=expert_capacity(factor, seq, k, experts))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert float(oc.summaries["dropped_fraction"]) == pytest.approx(dropped, abs=1e-6)


# ---- aux losses --------------------------------------------------------------------------


def test_aux_losses_uniform_router() -> None:
    cfg = _cfg(load_balance_loss_weight=0.1, router_z_loss_weight=0.01)
    moe, p = _init(cfg)
    p["router"] = jnp.zeros_like(p["router"])  # logits 0: uniform probabilities 1/E
    _, oc = _run(moe, p, _x((2, 5, 8)))
    lb, z = float(oc.summaries["load_balance_loss"]), float(oc.summaries["router_z_loss"])
    assert lb == pytest.approx(1.0, abs=1e-6)  # E * sum_e f_e / E = 1 for uniform P
    assert z == pytest.approx(math.log(4) ** 2, rel=1e-6)  # logsumexp(0 * 4) = log 4
    aux = float(oc.module_outputs["aux_loss"])
    assert aux == pytest.approx(0.1 * 1.0 + 0.01 * math.log(4) ** 2, rel=1e-6)
    # Ties go to the lowest ids: experts 0 and 1 get half the assignments each.
    assert float(oc.summaries["max_expert_load"]) == pytest.approx(2.0)


def test_aux_losses_collapsed_router_and_random_router() -> None:
    # All tokens to expert 0 with probability ~1 -> load balance ~E (its maximum).
    cfg = _cfg(num_experts_per_token=1)
    moe, p = _skewed_params(cfg)
    p["router"] = p["router"] * 50
    _, oc = _run(moe, p, jnp.abs(_x((1, 6, 8))) + 0.1)
    assert float(oc.summaries["load_balance_loss"]) == pytest.approx(4.0, rel=1e-3)
    # Random router: matches the formula in numpy.
    moe, p = _init(_cfg(router_z_loss_weight=1e-3))
    x = _x((2, 6, 8))
    _, oc = _run(moe, p, x)
    logits = np.asarray(x, np.float64).reshape(-1, 8) @ np.asarray(p["router"], np.float64)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    top = np.argsort(-probs, -1)[:, :2]
    frac = np.bincount(top.ravel(), minlength=4) / top.size
    lb = 4 * np.sum(frac * probs.mean(0))
    z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    assert float(oc.summaries["load_balance_loss"]) == pytest.approx(lb, rel=1e-5)
    assert float(oc.module_outputs["aux_loss"]) == pytest.approx(0.01 * lb + 1e-3 * z, rel=1e-5)


# ---- property test -----------------------------------------------------------------------


@settings(max_examples=12)
@given(
    batch=st.integers(1, 2),
    seq=st.integers(1, 6),
    dim=st.sampled_from([4, 8]),
    hidden=st.sampled_from([4, 6]),
    experts=st.integers(1, 5),
    data=st.data(),
)
def test_dropless_matches_numpy_reference(
    batch: int, seq: int, dim: int, hidden: int, experts: int, data: Any
) -> None:
    k = data.draw(st.integers(1, experts), label="k")
    scores = data.draw(st.sampled_from(["softmax", "sigmoid"]), label="scores")
    cfg = _cfg(
        input_dim=dim,
        hidden_dim=hidden,
        num_experts=experts,
        num_experts_per_token=k,
        router_scores=scores,
    )
    ragged, p = _init(cfg, seed=batch * 7 + seq)
    dense = cfg.clone(dropless_method="dense").instantiate()
    x = _x((batch, seq, dim), seed=experts)
    # Both dropless methods in one compiled function (one compile per example).
    y_ragged, y_dense = jax.jit(
        lambda p, x: (functional(ragged, None, p, (x,))[0], functional(dense, None, p, (x,))[0])
    )(p, x)
    ref, _ = np_moe(x, p, k, scores=scores)
    np.testing.assert_allclose(y_ragged, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y_dense, ref, rtol=1e-5, atol=1e-5)


# ---- HF Mixtral parity -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(dropless_method="dense"), dict(capacity_factor=2.0)],
    ids=["ragged_dot", "dense", "capacity"],
)
def test_matches_hf_mixtral_sparse_moe_block(kw: dict) -> None:
    with np.load(FIXTURE, allow_pickle=False) as f:
        fx = {name: f[name] for name in f.files}
    d, h = int(fx["hidden_size"]), int(fx["intermediate_size"])
    e, k = int(fx["num_experts"]), int(fx["top_k"])
    cfg = _cfg(input_dim=d, hidden_dim=h, num_experts=e, num_experts_per_token=k, **kw)
    moe = cfg.instantiate()
    gate_up = fx["gate_up_proj"]  # [E, 2H, D]: gate rows first, then up rows
    params = {
        "router": jnp.asarray(fx["gate_weight"].T),  # [E, D] -> [D, E]
        "wi_0": jnp.asarray(gate_up[:, :h].transpose(0, 2, 1)),
        "wi_1": jnp.asarray(gate_up[:, h:].transpose(0, 2, 1)),
        "wo": jnp.asarray(fx["down_proj"].transpose(0, 2, 1)),  # [E, D, H] -> [E, H, D]
    }
    if "capacity_factor" in kw:  # capacity >= every sequence: nothing may drop
        assert expert_capacity(2.0, fx["x"].shape[1], k, e) == fx["x"].shape[1]
    y, oc = _run(moe, params, jnp.asarray(fx["x"]))
    err = float(np.max(np.abs(np.asarray(y) - fx["y"])))
    assert err <= 1e-5, err
    assert float(oc.summaries["dropped_fraction"]) == 0.0


# ---- quantized dots, dtypes, sharding, errors --------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=4.0)], ids=["dropless", "capacity"])
def test_int8_dot_in_experts(kw: dict) -> None:
    moe, p = _init(_cfg(**kw))
    qmoe = _cfg(dot=Int8Dot.default_config(), **kw).instantiate()
    x = _x((2, 9, 8))
    y, _ = _run(moe, p, x)
    yq, _ = _run(qmoe, p, x)
    rel = float(jnp.linalg.norm(yq - y) / jnp.linalg.norm(y))
    assert rel < 0.03, rel
    g = jax.jit(jax.grad(lambda p: jnp.sum(functional(qmoe, None, p, (x,))[0] ** 2)))(p)
    assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(g))


def test_bf16_compute_close_to_f32() -> None:
    moe, p = _init(_cfg())
    x = _x((2, 9, 8))
    y, _ = _run(moe, p, x)
    yb, _ = _run(_cfg(dtype="bfloat16").instantiate(), p, x.astype(jnp.bfloat16))
    assert yb.dtype == jnp.bfloat16
    rel = float(jnp.linalg.norm(yb.astype(jnp.float32) - y) / jnp.linalg.norm(y))
    assert rel < 0.03, rel


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=2.0)], ids=["dropless", "capacity"])
def test_expert_parallel_by_logical_axes(kw: dict) -> None:
    """Experts sharded over a mesh axis purely through the logical 'expert' axis."""
    moe, p = _init(_cfg(**kw))
    x = _x((2, 8, 8))
    y_ref, _ = _run(moe, p, x)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))
    rules = {"batch": "data", "expert": "expert"}

    def spec_fn(axes: Any) -> PartitionSpec:
        return PartitionSpec(*(rules.get(a) for a in axes))

    shardings = parameter_shardings(moe.create_parameter_specs_recursively(), mesh, spec_fn)
    assert shardings["wi_0"].spec == PartitionSpec("expert", None, None)
    p = jax.device_put(p, shardings)
    with logical_sharding(mesh, spec_fn):
        y = jax.jit(lambda p, x: _run(moe, p, x)[0])(p, x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(MoEConfigError, match=r"moe\.num_experts_per_token"):
        _cfg(num_experts_per_token=5).instantiate()
    with pytest.raises(MoEConfigError, match=r"moe\.router_scores"):
        _cfg(router_scores="relu").instantiate()
    with pytest.raises(MoEConfigError, match=r"moe\.capacity_factor"):
        _cfg(capacity_factor=0.0).instantiate()
    with pytest.raises(MoEConfigError, match=r"moe\.activation"):
        _cfg(activation=("nope", "linear")).instantiate()


# ---- CPU grouped matmul (row blocks instead of ragged_dot's dense lowering) -------------


def _ragged_dot_forced(moe: Any) -> Any:
    """The module with the ragged_dot lowering forced (what non-CPU backends run)."""
    forced = moe.config.clone(name="forced").instantiate()
    forced._dropless_ragged = partial(  # type: ignore[method-assign]
        forced._dropless_sorted, forced._ragged_dot)
    return forced


@pytest.mark.parametrize("tokens,experts,k", [(64, 4, 2), (40, 8, 2), (9, 3, 1)])
def test_cpu_ragged_matmul_equals_ragged_dot(tokens: int, experts: int, k: int) -> None:
    cfg = _cfg(input_dim=8, hidden_dim=12, num_experts=experts, num_experts_per_token=k)
    moe, p = _init(cfg)
    ref = _ragged_dot_forced(moe)
    x = _x((2, tokens // 2 or 1, 8))

    def loss(m: Any) -> Any:
        def f(p: Any, x: Any) -> jax.Array:
            y, oc = functional(m, None, p, (x,))
            return jnp.sum(y**2) + oc.module_outputs["aux_loss"]

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

    (l1, g1), (l2, g2) = loss(moe)(p, x), loss(ref)(p, x)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_cpu_dropless_work_is_blocked_and_bf16() -> None:
    """On CPU the dropless train step does the expert work in row blocks of at most 128
    (XLA's ragged_dot lowering runs each expert over all T*k = 512 rows), and its expert
    dots stay bf16."""
    import re

    cfg = _cfg(input_dim=48, hidden_dim=96, num_experts=8, num_experts_per_token=2,
               dtype="bfloat16")
    moe, p = _init(cfg)
    x = _x((2, 128, 48)).astype(jnp.bfloat16)

    def compiled(m: Any) -> Any:
        def f(p: Any, x: Any) -> jax.Array:
            y, _ = functional(m, None, p, (x,))
            return jnp.sum(y.astype(jnp.float32) ** 2)

        return jax.jit(jax.grad(f, argnums=(0, 1))).lower(p, x).compile()

    text = compiled(moe).as_text()
    assert "512,96" in compiled(_ragged_dot_forced(moe)).as_text()
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", text))
    expert = [(m.group(1), types.get(m.group(2)), types.get(m.group(3))) for m in re.finditer(
        r"= \w+\[([\d,]+)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", text)
        if "96" in m.group(1).split(",")]
    assert len(expert) >= 6, expert  # 3 forward, 3 dx, 3 dW.
    assert all(int(n) <= 128 for dims, _, _ in expert for n in dims.split(",")), expert
    assert all((lhs, rhs) == ("bf16", "bf16") for _, lhs, rhs in expert), expert
    # Each block reads its expert's weight in place (`kernels.ragged_matmul`): no value
    # holds a copy of the weights or weight gradients per block ([blocks, 48|96, 96|48];
    # the experts' own are [8, ...], one dW block's [1, ...]).
    per_block = re.findall(r"\w+\[(\d+),(?:48,96|96,48)\]", text)
    assert set(per_block) <= {"1", "8"}, sorted(set(per_block))
