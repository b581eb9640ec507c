"""Mixed steps (`inference.mixed`): prompts pending beside decoding rows share their step.
The tokens, log-probabilities and penalties of every request are those of the engine
without mixed steps (greedy and seeded sampling, both attention kernels, a pool small
enough to preempt, grammar rows), steps do mix, and warm-up covers every step shape."""

import numpy as np
import pytest
from engine_testing import make_engine, tiny_config, tiny_params

from jaxlearn.kernels import paged_native

KERNELS = ["xla"] + (["native"] if paged_native.unavailable_reason() is None else [])


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return cfg, tiny_params(cfg, seed=3)


def _prompts(seed: int, lengths=(5, 40, 17, 3, 70, 9, 33)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 63, n))) for n in lengths]


def _run(model, tok, mixed: bool, prompts, **kw):
    settings = dict(max_batch=4, max_seq_len=128, prefill_chunk=32, mixed_steps=mixed)
    settings.update(kw.pop("engine", {}))
    engine = make_engine(*model, tok, **settings)
    results = engine.generate(prompts, ignore_eos=True, **kw)
    return engine, results


@pytest.mark.parametrize("kernel", KERNELS)
def test_mixed_steps_give_the_plain_engines_tokens_and_logprobs(model, tok, kernel):
    prompts = _prompts(0)
    kw = dict(max_new_tokens=10, temperature=0.9, seed=5, logprobs=2,
              presence_penalty=0.4, frequency_penalty=0.3)
    plain, want = _run(model, tok, False, prompts, engine={"attention_kernel": kernel}, **kw)
    mixed, got = _run(model, tok, True, prompts, engine={"attention_kernel": kernel}, **kw)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose([x.logprob for x in g.logprobs],
                                   [x.logprob for x in w.logprobs], atol=1e-5)
    # Seven prompts over four rows: later prompts arrive while others decode.
    steps = mixed.scheduler.metrics.counter_value
    assert steps("decode_calls_total", steps="mixed") > 0
    assert plain.scheduler.metrics.counter_value("decode_calls_total", steps="mixed") == 0


def test_mixed_steps_survive_preemption(model, tok):
    # A pool of 12 pages of 16 positions for 4 rows of up to 128: rows are preempted
    # and recomputed, their prompt + generated tokens prefilled in mixed steps.
    prompts = _prompts(1, (30, 50, 20, 45, 60))
    kw = dict(max_new_tokens=24, temperature=0.0)
    eng = {"kv_cache_tokens": 192, "prefix_caching": False}
    plain, want = _run(model, tok, False, prompts, engine=eng, **kw)
    mixed, got = _run(model, tok, True, prompts, engine=eng, **kw)
    assert mixed.scheduler.metrics.counter_value("preemptions_total") > 0
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_grammar_rows_join_mixed_steps():
    """Rows with a JSON schema decode in mixed steps with their masks: the same outputs."""
    pytest.importorskip("llguidance", reason="structured output needs llguidance")
    import jax

    from jaxlearn.layers import llama_config
    from jaxlearn.text.tokenizers import ByteTokenizer

    cfg = llama_config(320, 32, 2, 4, 2, 64, rope_theta=1e4, tie_embeddings=True)
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(1))
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy", "zzz"]}},
              "required": ["a"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": True}}
    prompts = ["a", "a longer prompt " * 3, "{", "xyz " * 9, "q"]
    outs = []
    for mixed in (False, True):
        engine = make_engine(cfg, params, ByteTokenizer(), max_seq_len=128, max_batch=2,
                             prefill_chunk=16, mixed_steps=mixed)
        outs.append(engine.generate(prompts, max_new_tokens=40, temperature=1.0, seed=3,
                                    response_format=rf))
    assert [r.tokens for r in outs[1]] == [r.tokens for r in outs[0]]
    assert all(r.text.startswith('{"a"') and r.finish_reason == "stop" for r in outs[1])
    assert engine.scheduler.metrics.counter_value("decode_calls_total", steps="mixed") > 0


def test_warmup_covers_every_mixed_step(model, tok):
    engine = make_engine(*model, tok, max_batch=4, max_seq_len=128, prefill_chunk=32)
    engine.warmup()
    kinds = {key[0] for key in engine.runner.programs}
    assert "rows" in kinds
    # Without LoRA slots or speculative decoding, prompts never take a plain prefill
    # unless they score their tokens.
    assert not any(key[0] == "prefill" and key[1] == (("scoring", False),)
                   for key in engine.runner.programs)
    engine.generate(_prompts(2, (3, 31, 64, 90, 7, 12, 50)), max_new_tokens=9,
                    ignore_eos=True)
    engine.generate([_prompts(3, (20,))[0]], max_new_tokens=3, prompt_logprobs=1,
                    ignore_eos=True)
    assert engine.runner.compiled_late == 0


def test_a_length_dependent_rope_keeps_the_plain_path(tok):
    """Dynamic NTK / LongRoPE rotate by the call's length (a mixed step is one row of all
    its rows' tokens, and cutting a prompt changes its rotation): no mixed steps."""
    from jaxlearn.layers.rope import DynamicNTKFrequencyScaling, scaling_config

    cfg = tiny_config()
    rope = cfg.decoder.transformer.layer.self_attention.rope
    rope.frequency_scaling = scaling_config({"rope_type": "dynamic", "factor": 2.0,
                                             "original_max_position_embeddings": 16})
    assert rope.frequency_scaling.klass is DynamicNTKFrequencyScaling
    engine = make_engine(cfg, tiny_params(cfg), tok, max_batch=4, max_seq_len=64)
    assert not engine.scheduler.mixed_steps
    plain = make_engine(*(lambda c: (c, tiny_params(c)))(tiny_config()), tok, max_batch=4,
                        max_seq_len=64)
    assert plain.scheduler.mixed_steps


def test_warmup_without_scoring_compiles_no_scoring_prefill(model, tok):
    engine = make_engine(*model, tok, max_batch=2, max_seq_len=48, prefill_chunk=32)
    new = engine.warmup(scoring=False)
    keys = list(engine.runner.programs)
    assert new == len(keys) and not any(k[1] == (("scoring", True),) for k in keys)
    assert {k[0] for k in keys} == {"decode", "rows"}  # Plain prefills only for adapters.
