"""The stored layout of served weights (`Engine.Config.weight_layout`): which Linear
configs become `TransposedLinear` or `PackedLinear` under each setting, logits and greedy
tokens equal to the trained layout's (bad settings: test_engine_config.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_engine, tiny_config, tiny_params

from jaxlearn.config import visit
from jaxlearn.inference.engine_setup import POOL_SPIN_US, pool_spin_for, rolled_layers
from jaxlearn.inference.quantize import quantize
from jaxlearn.inference.weight_layout import (
    apply_weight_layout,
    host_packs_float32,
    serving_stack,
    store_weights,
)
from jaxlearn.kernels import Int8Weight, PackedTable, pool_spin_us
from jaxlearn.kernels.packed_gemm import host_has_bf16, host_has_int8, unavailable_reason
from jaxlearn.layers import LoopStack, ScanStack, SgemmDot, use_dot, use_lora

PROMPT = [3, 17, 42, 9, 28, 5, 61, 12]


def _paths(tree):
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(k): v for k, v in leaves}


def _bf16(params):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)


def _untied_or_tied(cfg, tied):
    if tied:  # The embedding table doubles as the output head.
        cfg.decoder.lm_head = None
    return cfg.clone(name="model")


def _klasses(cfg):
    seen = []
    visit(cfg, lambda path, c: seen.append(c.klass.__name__)
          if hasattr(c, "keys") and "weight_axes" in c.keys() else None)
    return set(seen)


def _moved(params):
    """The Linear params' paths stored [out, in] (`weight_t`), without the leaf name."""
    return {k.removesuffix("['weight_t']") for k in _paths(params) if k.endswith("['weight_t']")}


@pytest.mark.parametrize("stack,tied", [("scan", False), ("scan", True), ("loop", False),
                                        ("loop", True)])
def test_auto_transposes_the_16_bit_dense_weights_only(stack, tied):
    cfg = _untied_or_tied(tiny_config(stack), tied)
    params = _bf16(tiny_params(cfg))
    new_cfg, out = apply_weight_layout(cfg, params, "auto")
    before = _paths(params)
    linears = {k.removesuffix("['weight']") for k in before
               if k.endswith("['weight']") and "['emb']" not in k}
    # Not the tied table (already [vocab, dim]), the norms or an untied embedding.
    assert _moved(out) == linears and _klasses(new_cfg) == {"TransposedLinear"}
    after = _paths(out)
    for k in linears:  # weight_t [*layers, out, in] is the weight [*layers, *in, *out].
        w, t = before[k + "['weight']"], after[k + "['weight_t']"]
        flat = np.asarray(w).reshape(*t.shape[:-2], -1, t.shape[-2])
        np.testing.assert_array_equal(np.swapaxes(np.asarray(t), -1, -2), flat)
    for k in before:
        if not k.endswith("['weight']") or "['emb']" in k:
            assert after[k] is before[k]
    shapes = jax.eval_shape(new_cfg.instantiate().initialize_parameters_recursively,
                            jax.random.key(0))
    assert jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(lambda x: x.shape, out)
    # f32 weights, a mesh, or int8 weights keep the trained layout under "auto".
    f32 = tiny_params(cfg)
    assert apply_weight_layout(cfg, f32, "auto") == (cfg, f32)
    assert apply_weight_layout(cfg, params, "auto", mesh_shape=(1, 8, 1)) == (cfg, params)
    qcfg, quant = quantize(cfg, params)
    assert apply_weight_layout(qcfg, quant, "auto")[0] is qcfg
    # "out_in" moves f32 weights too; "in_out" moves nothing.
    forced_cfg, forced = apply_weight_layout(cfg, f32, "out_in")
    assert _moved(forced) == linears and forced_cfg == new_cfg
    assert apply_weight_layout(cfg, params, "in_out") == (cfg, params)


def _engine(cfg, params, layout, fuse=False):
    return make_engine(cfg, params, None, max_seq_len=64, max_batch=4, prefill_chunk=16,
                       page_size=8, weight_layout=layout, fuse_projections=fuse)


@pytest.mark.parametrize("stack", ["scan", "loop"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_transposed_weights_serve_the_same_logits_and_tokens(stack, dtype):
    """Prefill logits within rounding of the summation order (f32 1e-5; bf16 weights and
    activations: a few bf16 ulps of the largest logit), and the same greedy tokens from
    batched decode (one and four rows)."""
    cfg = tiny_config(stack, dtype="bfloat16" if dtype == "bf16" else None)
    params = tiny_params(cfg, seed=1)
    if dtype == "bf16":
        params = _bf16(params)
    base, moved = _engine(cfg, params, "in_out"), _engine(cfg, params, "out_in")
    assert _moved(moved.runner.params) and not _moved(base.runner.params)
    ref = np.asarray(base.logits([PROMPT]))[0]
    got = np.asarray(moved.logits([PROMPT]))[0]
    tol = 1e-5 if dtype == "f32" else 4 * 2.0**-8 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)
    assert 0 < np.abs(ref).max()
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:], [7, 7, 7]]
    for rows in (prompts[:1], prompts):
        want = [r.tokens for r in base.generate(rows, max_new_tokens=12, ignore_eos=True)]
        got_tokens = [r.tokens for r in moved.generate(rows, max_new_tokens=12, ignore_eos=True)]
        assert got_tokens == want and all(len(t) == 12 for t in want)



def _packed_linears(params):
    return {k.removesuffix("['weight_id']") for k in _paths(params)
            if k.endswith("['weight_id']")}


@pytest.mark.parametrize("stack,tied", [("scan", True), ("loop", False)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_packed_weights_serve_the_same_logits_and_tokens(stack, tied, dtype, monkeypatch):
    """weight_layout="packed": every plain Linear a PackedLinear (a stack's ids per layer:
    a loop of one repeated layer is served as a scan of it, `roll_layers`), a tied head a
    PackedTable; prefill logits within rounding of the summation order and the same
    greedy tokens as the trained layout (a loop stays a loop there), one and four rows.
    The engine sets the kernels' pool spin for packed weights, off for the others."""
    monkeypatch.delenv("JAXLEARN_POOL_SPIN_US", raising=False)
    cfg = _untied_or_tied(tiny_config(stack, dtype="bfloat16" if dtype == "bf16" else None),
                          tied)
    params = tiny_params(cfg, seed=1)
    if dtype == "bf16":
        params = _bf16(params)
    base, packed = _engine(cfg, params, "in_out"), _engine(cfg, params, "packed")
    assert base.pool_spin_us == 0
    assert packed.pool_spin_us == pool_spin_us() == POOL_SPIN_US[
        "bfloat16" if dtype == "bf16" else "float32"]
    rolled = rolled_layers(cfg, params)[1]
    linears = {k.removesuffix("['weight']") for k in _paths(rolled)
               if k.endswith("['weight']") and "['emb']" not in k}
    assert _packed_linears(packed.runner.params) == linears
    assert _klasses(packed.model_cfg) == {"PackedLinear"}
    ids = {k: v for k, v in _paths(packed.runner.params).items() if k.endswith("['weight_id']")}
    assert all(v.dtype == jnp.int32 and v.shape == ((2,) if "['transformer']" in k else ())
               for k, v in ids.items())
    assert packed.model_cfg.decoder.transformer.klass is ScanStack
    assert base.model_cfg.decoder.transformer.klass is type(cfg.instantiate().decoder.transformer)
    table = packed.runner.params["decoder"]["emb"]["weight"]
    assert isinstance(table, PackedTable) == tied
    assert packed.packed_weights is not None and packed.packed_weights.nbytes > 0
    ref = np.asarray(base.logits([PROMPT]))[0]
    got = np.asarray(packed.logits([PROMPT]))[0]
    tol = 1e-5 if dtype == "f32" else 4 * 2.0**-8 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:], [7, 7, 7]]
    for rows in (prompts[:1], prompts):
        want = [r.tokens for r in base.generate(rows, max_new_tokens=12, ignore_eos=True)]
        got_tokens = [r.tokens for r in packed.generate(rows, max_new_tokens=12, ignore_eos=True)]
        assert got_tokens == want


@pytest.mark.skipif(unavailable_reason() is not None, reason="no packed GEMM here")
def test_a_run_trained_on_sgemm_dots_serves_packed():
    """A fine-tuning run's config names SgemmDot on every dense layer and the tied head
    (the CPU rule's `onemkl_dots`); serving drops it, so the weights are packed as for the
    plain config, with the same logits."""
    cfg = _untied_or_tied(tiny_config("scan"), tied=True)
    params = tiny_params(cfg, seed=1)
    trained = use_dot(cfg, SgemmDot.default_config())
    plain, packed = _engine(cfg, params, "packed"), _engine(trained, params, "packed")
    assert _packed_linears(packed.runner.params) == _packed_linears(plain.runner.params)
    assert isinstance(packed.runner.params["decoder"]["emb"]["weight"], PackedTable)
    np.testing.assert_array_equal(np.asarray(packed.logits([PROMPT])),
                                  np.asarray(plain.logits([PROMPT])))


def _fused(engine) -> bool:
    paths = _paths(engine.runner.params)
    return (any("['qkv_proj']" in k for k in paths)
            and any("['wi_fused']" in k for k in paths))


def test_projections_are_fused_by_default_where_packed_or_float32_on_xlas_dot():
    """fuse_projections=None: q/k/v and gate/up fused where the weights are packed or
    stay float32 on XLA's dot, with the unfused engine's logits and greedy tokens; bf16
    weights on XLA's dot stay unfused."""
    cfg = tiny_config("scan").clone(name="model")
    params = tiny_params(cfg, seed=1)
    base = _engine(cfg, params, "in_out")  # fuse_projections=False
    assert not any("qkv_proj" in k for k in _paths(base.runner.params))
    engines = [_engine(cfg, params, "in_out", None)]
    if unavailable_reason() is None:
        packed = _engine(cfg, params, "packed", None)
        assert any("['qkv_proj']['weight_id']" in k for k in _paths(packed.runner.params))
        engines.append(packed)
    ref = np.asarray(base.logits([PROMPT]))[0]
    rows = [PROMPT, PROMPT[:5], [7, 7, 7]]
    want = [r.tokens for r in base.generate(rows, max_new_tokens=12, ignore_eos=True)]
    for engine in engines:
        assert _fused(engine)
        np.testing.assert_allclose(np.asarray(engine.logits([PROMPT]))[0], ref, rtol=0,
                                   atol=1e-5)
        got = engine.generate(rows, max_new_tokens=12, ignore_eos=True)
        assert [r.tokens for r in got] == want
    bf16_cfg = tiny_config("scan", dtype="bfloat16").clone(name="model")
    assert not _fused(_engine(bf16_cfg, _bf16(params), "in_out", None))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_model_with_lora_linears_is_served_unfused(dtype):
    """Unmerged LoRA adapters: the default engine (packed where the host packs the
    dtype, else XLA's dot) keeps q/k/v apart and serves the fuse_projections=False engine's tokens;
    asking for fused projections says why it cannot."""
    bf16 = dtype == "bf16"
    cfg = use_lora(tiny_config("scan", dtype="bfloat16" if bf16 else None).clone(name="model"))
    params = tiny_params(cfg, seed=2)
    params = _bf16(params) if bf16 else params
    default, unfused = _engine(cfg, params, "auto", None), _engine(cfg, params, "auto")
    assert not _fused(default)
    rows = [PROMPT, [7, 7, 7]]
    want = [r.tokens for r in unfused.generate(rows, max_new_tokens=8, ignore_eos=True)]
    assert [r.tokens for r in default.generate(rows, max_new_tokens=8, ignore_eos=True)] == want
    with pytest.raises(ValueError, match="fuse_projections=True: the model has LoRA Linears"):
        _engine(cfg, params, "auto", True)


def test_auto_packs_bf16_weights_on_hosts_with_native_bf16_only():
    cfg = tiny_config("scan", dtype="bfloat16").clone(name="model")
    f32 = tiny_params(cfg)
    bf16 = _bf16(f32)
    _, out, owner = store_weights(cfg, bf16, "auto")
    assert (owner is not None) == host_has_bf16()
    assert bool(_packed_linears(out)) == host_has_bf16()
    # f32 weights under bf16 compute: XLA's dot, trained layout.
    assert store_weights(cfg, f32, "auto")[2] is None
    assert store_weights(cfg, bf16, "in_out") == (cfg, bf16, None)
    with pytest.raises(ValueError, match=r"weight_layout='packed' needs float32 or bfloat16 "
                                         r"Linear weights \(one dtype\), got \['float16'\]"):
        store_weights(cfg, jax.tree.map(lambda x: x.astype(jnp.float16), f32), "packed")


def test_auto_packs_f32_weights_where_the_avx512_kernel_takes_them():
    """f32 weights and compute: packed on the library's AVX-512 f32 panels where
    `host_packs_float32` (x86 with AVX512F, not Intel), with XLA's logits and tokens;
    elsewhere XLA's f32 dot on the trained layout."""
    cfg = tiny_config("scan").clone(name="model")
    params = tiny_params(cfg, seed=3)
    _, out, owner = store_weights(cfg, params, "auto")
    assert (owner is not None) == host_packs_float32()
    if owner is None:
        return
    assert owner.backends == {"avx512"} and owner.dtypes == {"float32"}
    assert bool(_packed_linears(out))
    xla, packed = _engine(cfg, params, "in_out", None), _engine(cfg, params, "auto", None)
    np.testing.assert_allclose(np.asarray(packed.logits([PROMPT]))[0],
                               np.asarray(xla.logits([PROMPT]))[0], rtol=0, atol=1e-5)
    rows = [PROMPT, PROMPT[:5], [7, 7, 7]]
    want = [r.tokens for r in xla.generate(rows, max_new_tokens=12, ignore_eos=True)]
    assert [r.tokens for r in packed.generate(rows, max_new_tokens=12, ignore_eos=True)] == want


def test_serving_stack_is_scanned_only_for_packed_weights():
    packs = host_has_bf16() and unavailable_reason() is None
    bf16 = dict(dtype="bfloat16", param_dtype="bfloat16")
    assert serving_stack("auto", **bf16) == ("scan" if packs else "loop")
    assert serving_stack("packed", dtype=None, param_dtype=None) == "scan"
    f32_packs = "scan" if host_packs_float32() else "loop"
    assert serving_stack("auto", dtype=None, param_dtype=None) == f32_packs
    assert serving_stack("auto", dtype="float32", param_dtype="float32") == f32_packs
    assert serving_stack("auto", dtype="bfloat16", param_dtype=None) == "loop"
    assert serving_stack("auto", dtype="float32", param_dtype="bfloat16") == "loop"
    assert serving_stack("auto", mesh_shape=(1, 8, 1), **bf16) == "loop"
    for layout in ("in_out", "out_in"):
        assert serving_stack(layout, **bf16) == "loop"


@pytest.mark.skipif(unavailable_reason() is not None, reason="no packed GEMM here")
@pytest.mark.parametrize("stack,tied", [("scan", True), ("loop", False)])
def test_packed_int8_weights_serve_what_xla_int8_serves(stack, tied):
    """quantize="int8" with weight_layout="packed": the Linears' weights quantized and
    packed as int8 (`PackedLinear`, weight_dtype "int8"), a tied head a `PackedTable` of
    an `Int8Weight`; the kernel's products are exact int32 sums with XLA's scales (bit
    for bit: kernels/tests), so on this model logits equal the XLA int8 engine's up to
    how XLA fuses the float ops around them (an ulp), and greedy tokens too (one and four
    rows), fused projections included."""
    cfg = _untied_or_tied(tiny_config(stack), tied)
    params = tiny_params(cfg, seed=1)

    def engine(layout, fuse):
        return make_engine(cfg, params, None, max_seq_len=64, max_batch=4, prefill_chunk=16,
                           page_size=8, weight_layout=layout, fuse_projections=fuse,
                           quantize="int8")

    base, packed, fused = engine("in_out", False), engine("packed", False), engine("packed", None)
    assert packed.packed_weights.dtypes == {"int8"}
    assert pool_spin_for(None, packed.packed_weights) == POOL_SPIN_US["int8"] == 30
    assert pool_spin_for(20, packed.packed_weights) == 20
    assert base.packed_weights is None and _klasses(base.model_cfg) == {"Int8Linear"}
    assert _klasses(packed.model_cfg) == {"PackedLinear"}
    weight_dtypes = set()
    visit(packed.model_cfg, lambda path, c: weight_dtypes.add(c.weight_dtype)
          if hasattr(c, "keys") and "weight_dtype" in c.keys() else None)
    assert weight_dtypes == {"int8"}
    table = packed.runner.params["decoder"]["emb"]["weight"]
    assert isinstance(table, PackedTable) == tied
    if tied:
        assert isinstance(table.table, Int8Weight)
    assert any("['qkv_proj']['weight_id']" in k for k in _paths(fused.runner.params))
    ref = np.asarray(base.logits([PROMPT]))[0]
    assert 0 < np.abs(ref).max()
    for e in (packed, fused):
        np.testing.assert_allclose(np.asarray(e.logits([PROMPT]))[0], ref, rtol=0,
                                   atol=1e-6 * np.abs(ref).max())
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:], [7, 7, 7]]
    for rows in (prompts[:1], prompts):
        want = [r.tokens for r in base.generate(rows, max_new_tokens=12, ignore_eos=True)]
        for e in (packed, fused):
            assert [r.tokens for r in e.generate(rows, max_new_tokens=12,
                                                 ignore_eos=True)] == want


def test_auto_packs_int8_weights_on_hosts_with_int8_dots_only():
    cfg = tiny_config("scan").clone(name="model")
    params = tiny_params(cfg)
    packs = host_has_int8() and unavailable_reason() is None
    new_cfg, out, owner = store_weights(cfg, params, "auto", quantize_mode="int8")
    assert (owner is not None) == packs and bool(_packed_linears(out)) == packs
    if not packs:  # XLA's int8 dot.
        assert _klasses(new_cfg) == {"Int8Linear"}
    _, out, owner = store_weights(cfg, params, "in_out", quantize_mode="int8")
    assert owner is None and not _packed_linears(out)
    assert serving_stack("auto", dtype=None, param_dtype=None, quantize="int8") == (
        "scan" if packs else "loop")


def test_rolled_layers_stack_a_loop_of_one_repeated_layer():
    """`rolled_layers`: a loop of one repeated layer -> the scan of that layer, its
    per-layer params stacked [layers, ...] in order; any other stack as it is."""
    loop_cfg = tiny_config("loop").set(name="model")
    assert loop_cfg.decoder.transformer.klass is LoopStack
    params = tiny_params(loop_cfg, seed=3)
    cfg, rolled = rolled_layers(loop_cfg, params)
    scan_cfg = tiny_config("scan").set(name="model")
    assert cfg.decoder.transformer == scan_cfg.decoder.transformer
    assert loop_cfg.decoder.transformer.klass is LoopStack  # The argument is unchanged.
    layers = params["decoder"]["transformer"]
    stacked = rolled["decoder"]["transformer"]["layer"]
    assert list(rolled["decoder"]["transformer"]) == ["layer"]
    assert jax.tree.structure(stacked) == jax.tree.structure(layers["layer0"])
    for i in range(2):
        jax.tree.map(lambda s, x, i=i: np.testing.assert_array_equal(s[i], x), stacked,
                     layers[f"layer{i}"])
    assert rolled["decoder"]["emb"] is params["decoder"]["emb"]
    for other in (scan_cfg, tiny_config("loop").set(name="model")):
        if other.decoder.transformer.klass is LoopStack:  # Different layers: a list.
            other.decoder.transformer.layers = [other.decoder.transformer.layer] * 2
            other.decoder.transformer.num_layers = None
        got_cfg, got_params = rolled_layers(other, params)
        assert got_cfg is other and got_params is params


@pytest.mark.skipif(unavailable_reason() is not None, reason="no packed GEMM here")
def test_the_rl_sampler_layout_keeps_a_loop_packed():
    """`roll_layers=False` (the RL sampler swaps the trainer's params in): a loop stays a
    loop even where its weights are packed."""
    cfg = tiny_config("loop")
    engine = make_engine(cfg, tiny_params(cfg, seed=1), None, max_seq_len=64, max_batch=4,
                         prefill_chunk=16, page_size=8, weight_layout="packed",
                         roll_layers=False)
    assert engine.model_cfg.decoder.transformer.klass is LoopStack
