"""The paged-attention kernel an Engine serves with (`Engine.Config.attention_kernel`):
"auto" picks the native kernel on one CPU device, every Attention layer carries the
choice, and the native kernel serves the XLA loop's logits and greedy tokens (prefill
chunks, batched decode, scanned and loop stacks, sliding windows); bad settings:
test_engine_config.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_engine, tiny_config, tiny_params

from jaxlearn.config import replace_config, visit
from jaxlearn.kernels.paged_native import choose_kernel, unavailable_reason
from jaxlearn.layers import Attention

PROMPT = [3, 17, 42, 9, 28, 5, 61, 12, 33, 8, 19, 50, 4, 27, 11, 40, 22, 6, 31]


def _kernels(cfg):
    seen = []
    visit(cfg, lambda path, c: seen.append(c.paged_kernel)
          if hasattr(c, "keys") and "paged_kernel" in c.keys() else None)
    return set(seen)


def _engine(cfg, params, kernel):
    return make_engine(cfg, params, None, max_seq_len=64, max_batch=4, prefill_chunk=16,
                       page_size=8, attention_kernel=kernel)


def test_auto_chooses_native_on_one_cpu_device():
    assert jax.default_backend() == "cpu" and unavailable_reason() is None
    assert choose_kernel("auto", one_device=True) == "native"
    assert choose_kernel("auto", one_device=False) == "xla"  # A mesh: XLA's loop.
    assert choose_kernel("xla", one_device=True) == "xla"
    cfg = tiny_config()
    engine = _engine(cfg, tiny_params(cfg), "auto")
    assert engine.attention_kernel == "native" and _kernels(engine.model_cfg) == {"native"}
    assert _kernels(engine.base_model_cfg) == {"xla"}  # What adapter files are read for.


@pytest.mark.parametrize("stack,window,dtype", [("scan", None, "f32"), ("loop", 12, "f32"),
                                                ("scan", None, "bf16")])
def test_native_serves_the_xla_logits_and_tokens(stack, window, dtype):
    """Prefill logits (two chunks of 16) within f32 rounding (bf16: a few bf16 ulps of the
    largest logit) and the same greedy tokens from batched decode, one and four rows."""
    bf16 = dtype == "bf16"
    cfg = tiny_config(stack, dtype="bfloat16" if bf16 else None)
    if window is not None:
        cfg = replace_config(cfg, Attention.Config,
                             lambda old, path: old.clone(sliding_window=window))
    params = tiny_params(cfg, seed=2)
    if bf16:
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    xla, native = _engine(cfg, params, "xla"), _engine(cfg, params, "native")
    assert _kernels(xla.model_cfg) == {"xla"} and _kernels(native.model_cfg) == {"native"}
    ref = np.asarray(xla.logits([PROMPT]))[0]
    got = np.asarray(native.logits([PROMPT]))[0]
    tol = 4 * 2.0**-8 * np.abs(ref).max() if bf16 else 1e-5
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:], [7, 7, 7]]
    for rows in (prompts[:1], prompts):
        want = [r.tokens for r in xla.generate(rows, max_new_tokens=20, ignore_eos=True)]
        got_tokens = [r.tokens for r in native.generate(rows, max_new_tokens=20,
                                                        ignore_eos=True)]
        assert got_tokens == want
