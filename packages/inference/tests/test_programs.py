"""The engine's program set is fixed by its shapes: sampling features never compile a
program, warm-up compiles what the scheduler reaches, and a probe of many feature
combinations after warm-up neither compiles nor grows the process."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from engine_testing import make_engine

from jaxlearn.inference import programs

PROBE = textwrap.dedent('''
    import json, sys
    import jax
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    import numpy as np
    from jaxlearn.inference import Engine
    from jaxlearn.layers import llama_config
    from jaxlearn.text.tokenizers import ByteTokenizer

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    cfg = llama_config(320, 32, 2, 4, 2, 64, rope_theta=1e4, tie_embeddings=True)
    params = cfg.clone(name="model").instantiate().initialize_parameters_recursively(
        jax.random.PRNGKey(1))
    engine = Engine.default_config().set(
        max_seq_len=256, max_batch=4, prefill_chunk=32, decode_burst=4).instantiate(
        model_cfg=cfg, params=params, tokenizer=ByteTokenizer())
    compiled = engine.warmup("auto", threads=1)
    engine.generate("warm", max_new_tokens=2)  # First-call allocations of the host side.
    before, warm_rss = len(engine.runner.programs), rss()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rng = np.random.default_rng(0)
    combos = []
    for i in range(50):
        kw = dict(max_new_tokens=int(rng.integers(0, 24)), seed=i)
        if i % 2:
            kw.update(temperature=float(rng.uniform(0.1, 2.0)))
        if i % 3 == 1:
            kw.update(top_k=int(rng.integers(1, 50)))
        if i % 5 == 2:
            kw.update(top_p=float(rng.uniform(0.1, 0.99)))
        if i % 4 == 3:
            kw.update(logprobs=int(rng.integers(0, 21)))
        if i % 7 == 4:
            kw.update(prompt_logprobs=int(rng.integers(0, 21)))
        if i % 6 == 5:
            width = int(2 ** rng.integers(0, 9))
            kw.update(logit_bias={int(t): 1.0 for t in rng.choice(300, min(width, 300),
                                                                  replace=False)})
        if i % 8 == 6:
            kw.update(presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3)
        if i % 9 == 7 and not kw.get("max_new_tokens") == 0:
            kw.update(response_format={"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": schema}})
        if i % 10 == 8:
            kw.update(stop=["e", "zz"])
        rows = 1 + i % 4
        prompt = ["the prompt %d" % j for j in range(rows)]
        engine.generate(prompt if rows > 1 else prompt[0], **kw)
        combos.append(sorted(kw))
    print(json.dumps({"compiled": compiled, "before": before,
                      "after": len(engine.runner.programs),
                      "late": engine.runner.compiled_late, "warm_rss": warm_rss,
                      "rss": rss(), "kinds": len({tuple(c) for c in combos})}))
''')


def test_feature_probe_after_warmup_compiles_nothing_and_keeps_rss(tmp_path):
    """50 requests, each a different mix of sampling features (greedy / temperature /
    top-k / top-p, logprobs k, prompt logprobs, logit bias of 1-256 entries, penalties,
    a JSON schema, stop strings, 1-4 rows), after the "auto" warm-up: no program is
    compiled and the resident memory stays within 5% of what it was after warm-up. Run
    in a fresh process so the RSS is this engine's alone."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cache = os.environ.get("JAXLEARN_COMPILATION_CACHE") or "/tmp/jaxlearn-jax-cache"
    out = subprocess.run([sys.executable, str(script), cache], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kinds"] >= 20, got
    assert got["late"] == 0 and got["after"] == got["before"], got
    assert got["rss"] <= 1.05 * got["warm_rss"], got


def test_warmup_covers_every_program_the_scheduler_runs(cfg, params, tok):
    """After the default warm-up, a random workload (prompt lengths from 1 to near
    max_seq_len, several rows, bursts and single steps, scoring calls) compiles nothing
    more: no length is part of a program's shape."""
    eng = make_engine(cfg, params, tok, max_seq_len=128, max_batch=3, prefill_chunk=32,
                      decode_burst=4, page_size=16)
    new = eng.warmup("auto", threads=2)
    shapes = list(programs.reachable(eng.scheduler))
    assert new == len(shapes) == len(eng.runner.programs)
    rng = np.random.default_rng(3)
    for i in range(12):
        n = int(rng.integers(1, 4))
        prompts = [[int(t) for t in rng.integers(3, 60, int(rng.integers(1, 120)))]
                   for _ in range(n)]
        room = 128 - max(len(p) for p in prompts)
        kw = dict(max_new_tokens=int(rng.integers(0, min(room, 40))), ignore_eos=True)
        if i % 3 == 0:
            kw.update(prompt_logprobs=2, logprobs=1)
        eng.generate(prompts, **kw)
    assert eng.runner.compiled_late == 0
    assert len(eng.runner.programs) == len(shapes)


def test_no_warmup_counts_late_compiles(cfg, params, tok):
    eng = make_engine(cfg, params, tok, max_seq_len=64, max_batch=2)
    assert eng.warmup("none") == 0 and eng.runner.sealed
    eng.generate("abc", max_new_tokens=2)
    assert eng.runner.compiled_late >= 1
    assert "programs_compiled_late" in eng.metrics.render()


def test_bad_warmup_level(cfg, params, tok):
    eng = make_engine(cfg, params, tok, max_seq_len=64, max_batch=2)
    with pytest.raises(ValueError, match="warmup='most'"):
        eng.warmup("most")


def test_step_time_is_split_into_prefill_decode_and_host(cfg, params, tok):
    """`step_part_seconds_total` splits the steps' time (prefill and decode calls, the
    host rest) and adds up to it; `decode_calls_total` counts calls by fused steps."""
    eng = make_engine(cfg, params, tok, max_seq_len=64, max_batch=2, decode_burst=4)
    eng.generate(["abc", "de"], max_new_tokens=9, ignore_eos=True)
    m = eng.metrics
    parts = {p: m.counter_value("step_part_seconds_total", part=p)
             for p in ("prefill", "decode", "host")}
    assert all(v > 0 for v in parts.values()), parts
    text = m.render()
    total = float(next(line.split()[-1] for line in text.splitlines()
                       if line.startswith("jaxlearn_step_seconds_sum")))
    assert abs(sum(parts.values()) - total) < 1e-6 * max(1.0, total) + 1e-3, (parts, total)
    bursts = m.counter_value("decode_calls_total", steps="4")
    singles = m.counter_value("decode_calls_total", steps="1")
    # 9 tokens: the first from prefill, then 8 decoded: two bursts of 4 (nobody waits).
    assert (bursts, singles) == (2, 0), (bursts, singles)
    # One mixed step of 16 tokens for prompts of 3 and 2 (+ BOS) tokens, nobody decoding.
    assert m.counter_value("prefill_calls_total") == 1
    assert m.counter_value("prefill_padded_tokens_total") == 16
