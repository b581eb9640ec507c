"""jaxlearn training throughput through the real `Trainer` step.

The model is `llama_config` (plus `experiments.recipes.moe` for the Mixtral-style one), the
optimizer the `Learner` (AdamW, clip 1.0), the step `Trainer.compile_train_step` (jit with
the state shardings, donation, non-finite guard): exactly what `jaxlearn train` runs, minus
the input pipeline (a fixed random batch with all the pipeline's features).

    python jl_train.py --model llama --dtype bf16 --stack loop --steps 6

Emits compile time, median step time, tokens/s, model FLOP/s (common.train_flops_per_token),
the compiled FLOPs, and (with --hlo) the dot/transposes statistics of the compiled HLO.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import Counter
from typing import Any

from common import Timer, emit, log, med, model_cfg, rnd, train_flops_per_token


def recipe_trainer(config: str, batches: str, overrides: tuple[str, ...] = ()) -> Any:
    """(trainer, host batch) of a recipe: the flat config `jaxlearn config` printed (with
    its `init_from`), `overrides` applied, and the first batch of an .npz of stacked
    batches (`lora_bench.py data`)."""
    import tempfile

    import numpy as np

    from jaxlearn.config import from_flat_text
    from jaxlearn.config.overrides import apply_overrides

    with open(config) as f:
        cfg = apply_overrides(from_flat_text(f.read()), overrides)
    cfg.output_dir = tempfile.mkdtemp(prefix="jlbench_")
    with np.load(batches) as z:
        batch = {k: z[k][0] for k in z.files}
    return cfg.instantiate(), batch


def build_trainer(c: dict[str, Any], *, dtype: str, stack: str, remat: str | None,
                  nonfinite: str, moe_method: str, mesh_shape: Any = None,
                  attention: str = "einsum", loss_chunk: int | None = None,
                  overrides: tuple[str, ...] = ()) -> Any:
    from jaxlearn.experiments.common import small_model_mesh_rules, trainer_config
    from jaxlearn.layers import llama_config
    from jaxlearn.runtime.input_pipeline import Input

    model = llama_config(
        c["vocab"], c["dim"], c["layers"], c["heads"], c["kv_heads"], c["ffn"],
        rope_theta=c["rope_theta"], norm_eps=c["norm_eps"], stack=stack,
        dtype="bfloat16" if dtype == "bf16" else None, remat_policy=remat,
        attention_implementation=attention,
    )
    if loss_chunk is not None and hasattr(model, "loss_chunk_tokens"):
        model.loss_chunk_tokens = loss_chunk or None  # 0: the plain loss over full logits.
    if "experts" in c:
        try:
            from jaxlearn.layers import use_moe
        except ImportError:  # Older tree: the experiments helper.
            from jaxlearn.experiments.recipes import moe as use_moe  # type: ignore
        model = use_moe(model, num_experts=c["experts"], top_k=c["top_k"],
                        dropless_method=moe_method)
    # The recipes' input config (never instantiated here: the batch is random).
    inp = Input.default_config().set(seq_len=c["seq"], global_batch_size=c["batch"])
    cfg = trainer_config(model, inp, max_step=1000,
                         learning_rate=3e-4, warmup_steps=0, mesh_rules=small_model_mesh_rules())
    cfg.output_dir = "/tmp/unused-bench"
    cfg.resilience.nonfinite = nonfinite
    if mesh_shape is not None:
        cfg.mesh_shape = mesh_shape
    if overrides:  # `--set`-style "path=value" on the trainer config.
        from jaxlearn.config.overrides import apply_overrides

        apply_overrides(cfg, overrides)
    return cfg.instantiate()


def random_batch(c: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    b, s = c["batch"], c["seq"]
    ids = rng.integers(0, c["vocab"], size=(b, s + 1)).astype(np.int32)
    return {
        "input_ids": ids[:, :-1],
        "target_labels": ids[:, 1:],
        "target_weights": np.ones((b, s), np.float32),
        "segment_ids": np.ones((b, s), np.int32),
        "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy(),
    }


_DEF = re.compile(r"%([\w.\-]+) = (\w+)\[")
_DOT = re.compile(r"%[\w.\-]+ = (\w+)\[[^\]]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)")


def hlo_stats(text: str) -> dict[str, Any]:
    """Dots by (lhs, rhs -> out) dtype, and transposes/copies, in the optimised HLO."""
    types = dict(_DEF.findall(text))
    dots: Counter[str] = Counter()
    for m in _DOT.finditer(text):
        dots[f"{types.get(m.group(2))},{types.get(m.group(3))}->{m.group(1)}"] += 1
    return {
        "dots": dict(dots),
        "transposes": len(re.findall(r" transpose\(", text)),
        "copies": len(re.findall(r" copy\(", text)),
        "converts": len(re.findall(r" convert\(", text)),
        "ynn_fusions": len(re.findall(r"__ynn_fusion", text)),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama", choices=["llama", "mixtral"])
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--stack", default="loop", choices=["loop", "scan"])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--remat", default=None)
    p.add_argument("--nonfinite", default="skip", choices=["skip", "off"])
    p.add_argument("--moe-method", default="ragged_dot", choices=["ragged_dot", "dense"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--hlo", default=None, help="write the optimised HLO text here")
    p.add_argument("--loss-chunk", type=int, default=None,
                   help="CausalLM.loss_chunk_tokens (0: plain loss; default: the model's)")
    p.add_argument("--set", action="append", default=[],
                   help="trainer config override PATH=VALUE (repeatable)")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    import jax
    import numpy as np

    # Compile times must be real compiles: never served from a persistent cache.
    jax.config.update("jax_enable_compilation_cache", False)
    c = model_cfg(args.model, layers=args.layers)
    trainer = build_trainer(c, dtype=args.dtype, stack=args.stack, remat=args.remat,
                            nonfinite=args.nonfinite, moe_method=args.moe_method,
                            loss_chunk=args.loss_chunk, overrides=tuple(args.set))
    batch = trainer.global_batch(random_batch(c))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
    state = trainer.init_state()
    jax.block_until_ready(state)
    nparams = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))

    fn = jax.jit(trainer._step, in_shardings=(trainer.state_shardings, trainer.batch_sharding),
                 out_shardings=(trainer.state_shardings, trainer._replicated), donate_argnums=(0,))
    with jax.set_mesh(trainer.mesh), trainer._logical():
        with Timer() as t_lower:
            lowered = fn.lower(trainer.abstract_state(derived=True), abstract)
        with Timer() as t_comp:
            compiled = lowered.compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    stats = hlo_stats(text)
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(text)
    common = dict(
        bench="train", framework="jaxlearn", version=jax.__version__, model=args.model,
        dtype=args.dtype, stack=args.stack, layers=c["layers"], remat=args.remat or "none",
        nonfinite=args.nonfinite, params=nparams, batch=c["batch"], seq=c["seq"],
        lower_s=rnd(t_lower.wall), compile_s=rnd(t_comp.wall),
        compiled_flops=float(cost.get("flops", 0.0)) if cost else None,
        compiled_bytes_accessed=float(cost.get("bytes accessed", 0.0)) if cost else None,
        temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0) or 0),
        hlo=stats, tag=args.tag, loss_chunk=args.loss_chunk,
        overrides=args.set,
    )
    if args.model == "mixtral":
        common["moe_method"] = args.moe_method
    if args.compile_only:
        emit(**common)
        return

    step_fn = compiled
    losses = []
    with jax.set_mesh(trainer.mesh):
        for _ in range(args.warmup):
            state, summ = step_fn(state, batch)
            losses.append(float(summ["loss"]))
        times, cpus, cpu_s = [], [], []
        for _ in range(args.steps):
            with Timer() as t:
                state, summ = step_fn(state, batch)
                loss = float(summ["loss"])  # Blocks on the step.
            times.append(t.wall)
            cpus.append(t.util())
            cpu_s.append(t.cpu)
            losses.append(loss)
    dt = med(times)
    tokens = c["batch"] * c["seq"]
    flops = train_flops_per_token(c) * tokens
    log(f"jaxlearn {args.model} {args.dtype} {args.stack}: {dt:.3f} s/step, "
        f"{tokens / dt:.0f} tok/s, losses {losses[0]:.3f}..{losses[-1]:.3f}")
    emit(**common, step_s=rnd(dt), step_times=[rnd(x) for x in times],
         tokens_per_s=rnd(tokens / dt), model_flops_per_step=flops,
         model_gflops=rnd(flops / dt / 1e9), cpu_util=rnd(med(cpus), 3),
         step_cpu_s=rnd(med(cpu_s)),
         loss_first=rnd(losses[0]), loss_last=rnd(losses[-1]), wall_time=time.time())


if __name__ == "__main__":
    main()
