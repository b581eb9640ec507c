"""Engine.Config: flat text round trip, one-line validation errors; an engine without a
tokenizer serves token ids over the model's whole vocabulary."""

import numpy as np
import pytest
from conftest import make_engine, prompt_pool, tiny_params

from jaxlearn.config import apply_overrides, to_flat_text
from jaxlearn.inference import ByteTokenizer, Engine, RequestError
from jaxlearn.layers import llama_config

SETTINGS = dict(max_seq_len=64, max_batch=2, prefill_chunk=16, decode_burst=4, max_queue=3,
                page_size=8, kv_cache_tokens=96, add_bos=False, model_name="tiny-ids")


def _overrides(text: str) -> list[str]:
    """`path=value` overrides that rebuild a flat text (klass stays the default's)."""
    return [line.replace(": ", "=", 1) for line in text.splitlines()
            if not line.startswith("klass:")]


def test_engine_config_flat_text_round_trip(cfg, params, tok):
    ecfg = Engine.default_config().set(**SETTINGS, mesh_shape=(1, 2, 4),
                                       axis_rules=(("batch", None), ("embed", "fsdp")))
    text = to_flat_text(ecfg)
    assert "max_batch: 2\n" in text and "mesh_shape: (1, 2, 4)\n" in text
    assert "klass: jaxlearn.inference.engine.Engine\n" in text
    again = Engine.default_config()
    apply_overrides(again, _overrides(text))
    assert to_flat_text(again) == text
    # The engine keeps its own copy, and its settings are the config's.
    ecfg = Engine.default_config().set(**SETTINGS)
    engine = ecfg.instantiate(model_cfg=cfg, params=params, tokenizer=tok)
    ecfg.max_batch = 7
    assert to_flat_text(engine.config) == to_flat_text(Engine.default_config().set(**SETTINGS))
    assert (engine.max_batch, engine.max_seq_len, engine.model_name) == (2, 64, "tiny-ids")
    assert engine.scheduler.max_queue == 3 and engine.runner.page_size == 8
    assert engine.runner.num_pages == 96 // 8 + 1 and not engine.add_bos


@pytest.mark.parametrize("settings,message", [
    (dict(page_size=24), "Engine.Config.page_size=24: must be a power of two <= 64"),
    (dict(max_batch=0), "Engine.Config.max_batch=0: must be >= 1"),
    (dict(max_seq_len=1), "Engine.Config.max_seq_len=1: must be >= 2"),
    (dict(decode_burst=0), "Engine.Config.decode_burst=0: must be >= 1"),
    (dict(pool_spin_us=-5), "Engine.Config.pool_spin_us=-5: must be None or an int >= 0"),
    (dict(pool_spin_us=1.5), "Engine.Config.pool_spin_us expects Optional[int], got float 1.5"),
    (dict(max_seq_len=64, kv_cache_tokens=48), "Engine.Config.kv_cache_tokens=48: cannot hold"),
    (dict(fuse_projections=True, mesh_shape=(1, 8)), "fuse_projections=True needs mesh_shape"),
    (dict(mesh_shape=(3, 5)), "Engine.Config.mesh_shape=(3, 5)"),
    (dict(weight_layout="nk"),
     "Engine.Config.weight_layout='nk': must be one of auto, in_out, out_in, packed"),
    (dict(weight_layout="out_in", mesh_shape=(1, 8, 1)),
     "Engine.Config.weight_layout='out_in' needs mesh_shape=None"),
    (dict(weight_layout="packed", mesh_shape=(1, 8, 1)),
     "Engine.Config.weight_layout='packed' needs mesh_shape=None"),
    (dict(attention_kernel="cuda"),
     "Engine.Config.attention_kernel='cuda': must be one of auto, xla, native"),
    (dict(attention_kernel="native", mesh_shape=(1, 8, 1)),
     "Engine.Config.attention_kernel='native' needs mesh_shape=None"),
])
def test_bad_settings_are_one_line_errors_naming_the_field(cfg, params, tok, settings, message):
    with pytest.raises(ValueError) as info:
        make_engine(cfg, params, tok, **settings)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def wide():
    """A model of vocabulary 512 (more ids than the byte tokenizer's 320)."""
    model = llama_config(512, 32, 2, 4, 2, 64, rope_theta=10000.0)
    return model, tiny_params(model, seed=3)


def test_engine_without_tokenizer_samples_the_whole_vocabulary(wide):
    model, params = wide
    engine = make_engine(model, params, None, max_seq_len=96, max_batch=2, prefill_chunk=16,
                         decode_burst=4)
    assert engine.tokenizer is None and engine.vocab_size == 512 and not engine.add_bos
    prompt = [400, 17, 311, 505]
    kw = dict(max_new_tokens=64, temperature=1.0, seed=5)
    res = engine.generate(prompt, **kw)
    assert len(res.tokens) == 64 and res.finish_reason == "length" and res.text == ""
    assert max(res.tokens) >= 320 and min(res.tokens) >= 0 and max(res.tokens) < 512
    assert res.prompt_ids == prompt
    # Greedy continuation: the argmax over all 512 logits.
    greedy = engine.generate(prompt, max_new_tokens=1)
    assert greedy.tokens == [int(np.argmax(engine.logits([prompt])[0, -1]))]
    # Stops are token ids; streams carry ids and no text.
    stop = res.tokens[10]
    cut = engine.generate(prompt, **kw, stop=stop)
    assert cut.tokens == res.tokens[: res.tokens.index(stop) + 1] and cut.stop_reason == stop
    deltas = list(engine.stream(prompt, **kw))
    assert sum((d.tokens for d in deltas), []) == res.tokens
    assert all(d.text == "" for d in deltas)
    # The same model with the byte tokenizer never samples an id it cannot decode.
    byte = make_engine(model, params, ByteTokenizer(), max_seq_len=96, max_batch=2,
                       prefill_chunk=16, decode_burst=4)
    assert max(byte.generate(prompt, **kw, ignore_eos=True).tokens) < 320


def test_engine_without_tokenizer_refuses_text(wide):
    model, params = wide
    engine = make_engine(model, params, None, max_seq_len=32, max_batch=1, prefill_chunk=16)
    with pytest.raises(RequestError, match="no tokenizer") as info:
        engine.generate("Once upon", max_new_tokens=2)
    assert info.value.param == "prompt"
    with pytest.raises(RequestError, match="need a tokenizer") as info:
        engine.generate(prompt_pool(1, 4)[0], max_new_tokens=2, stop=["\n"])
    assert info.value.param == "stop"
