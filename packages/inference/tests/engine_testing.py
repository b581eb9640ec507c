"""Tiny models and engines shared by the inference and serve tests (vocab 64, dim 32,
2 layers): plain helpers plus the session fixtures `tok`, `cfg`, `params`, `engine`,
which each package's conftest imports."""

import jax
import numpy as np
import pytest

from jaxlearn.layers import llama_config

ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?01"  # ids 3..62


class CharTokenizer:
    """One character per token: pad 0, bos 1, eos 2, ALPHABET[i] -> i + 3, id 63 -> '#'."""

    vocab_size = 64
    bos_id = 1
    eos_id = 2

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) + 3 if c in ALPHABET else 63 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(ALPHABET[i - 3] if 3 <= i < 3 + len(ALPHABET) else "#"
                       for i in map(int, ids) if i >= 3)


def tiny_config(stack: str = "scan", **kw):
    return llama_config(64, 32, 2, 4, 2, 64, rope_theta=10000.0, stack=stack, **kw)


def tiny_params(cfg, seed: int = 0):
    return cfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(seed))


@pytest.fixture(scope="session")
def tok():
    return CharTokenizer()


@pytest.fixture(scope="session")
def cfg():
    return tiny_config()


@pytest.fixture(scope="session")
def params(cfg):
    return tiny_params(cfg)


def make_engine(model_cfg, params, tokenizer, **settings):
    """An Engine with `settings` as its `Engine.Config` fields."""
    from jaxlearn.inference import Engine

    return Engine.default_config().set(**settings).instantiate(
        model_cfg=model_cfg, params=params, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def engine(cfg, params, tok):
    """Shared engine: 4 slots of 64 tokens, prefill chunks of 16, decode bursts of 4."""
    return make_engine(cfg, params, tok, max_seq_len=64, max_batch=4, prefill_chunk=16,
                       decode_burst=4, max_queue=8, model_name="tiny")


def prompt_pool(n: int = 8, length: int = 60, seed: int = 0) -> list[list[int]]:
    """Random prompts of token ids in [3, 63) (no special ids)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 63, size=length).tolist() for _ in range(n)]


def reference_greedy(engine, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by re-running the cache-free forward on the whole sequence
    (always padded to max_seq_len, so one compiled program)."""
    seq = list(prompt)
    out = []
    for _ in range(n):
        if len(seq) >= engine.max_seq_len:
            break
        ids = np.zeros((1, engine.max_seq_len), np.int32)
        ids[0, : len(seq)] = seq
        nxt = int(np.argmax(engine.logits(ids)[0, len(seq) - 1]))
        out.append(nxt)
        seq.append(nxt)
    return out


def run(engine, jobs):
    """Submits (prompt, sampling kwargs, arrival step) jobs at their steps and steps the
    scheduler until all are done; returns [(tokens, [(token, logprob, top)])]."""
    sched = engine.scheduler
    made = [(at, engine.request(p, engine.sampling_params(ignore_eos=True, **kw)))
            for p, kw, at in jobs]
    pending = sorted(made, key=lambda x: x[0])
    step = 0
    while pending or not all(r.done for _, r in made):
        while pending and pending[0][0] <= step:
            sched.submit(pending.pop(0)[1])
        sched.step()
        step += 1
    assert sched.pages.num_used == 0
    return [(r.output.tokens, [(e.token, e.logprob, e.top) for e in r.logprobs])
            for _, r in made]


def assert_same(got, want):
    for (toks, lps), (ref_toks, ref_lps) in zip(got, want):
        assert toks == ref_toks
        assert [t for t, _, _ in lps] == [t for t, _, _ in ref_lps]
        np.testing.assert_allclose([lp for _, lp, _ in lps], [lp for _, lp, _ in ref_lps],
                                   atol=1e-5)
        for (_, _, top), (_, _, ref_top) in zip(lps, ref_lps):
            assert [i for i, _ in top] == [i for i, _ in ref_top]
            np.testing.assert_allclose([x for _, x in top], [x for _, x in ref_top], atol=1e-5)


def lora_model(cfg, base, rank: int, seed: int):
    """(config, params) of a LoRA model on `base` params with random, non-zero lora_a and
    lora_b (a fresh adapter's lora_b is zero) and alpha = 3 x rank (scale 3)."""
    from jaxlearn.layers import use_lora, with_base_params

    lcfg = use_lora(cfg.clone(name="model"), rank=rank, alpha=3.0 * rank)
    p = lcfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(seed))
    key = jax.random.PRNGKey(seed + 1000)

    def fill(path, x):
        if "lora_b" in jax.tree_util.keystr(path):
            return 0.3 * jax.random.normal(jax.random.fold_in(key, x.size), x.shape, x.dtype)
        return x

    return lcfg, with_base_params(jax.tree_util.tree_map_with_path(fill, p), base)
