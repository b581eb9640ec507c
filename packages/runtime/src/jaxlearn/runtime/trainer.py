"""The SPMD trainer: one jitted, sharded, donated train step in a loop.

Checkpoints cost the loop almost nothing: the step right after a save runs a non-donating
variant of the same step, so the saved state's device buffers stay valid and the
checkpointer can copy them to host on its background thread (`save(..., snapshot=False)`)
instead of blocking the loop for the copy.

State = {"params", "opt_state", "prng_key", "step"} (+ "ema"), sharded per the mesh and
the logical axis rules. The model is any `jaxlearn.module.Module` whose `forward(batch)`
returns `(loss, metrics)`; auxiliary losses (MoE) are the model's to add. Recipes put a
model config into `model` (the trainer imports no layers); `init_from` loads pretrained
params into the param shardings (`runtime.init_from`) when there is no checkpoint yet."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.checkpoint import storage
from jaxlearn.config import REQUIRED, Configurable, InstantiableConfig, below_minimum, to_flat_text
from jaxlearn.mesh import (
    MeshFieldsConfig,
    logical_to_partition_spec,
    mesh_from_config,
    mesh_shape_from_axes,
)
from jaxlearn.module import Module, is_spec, logical_sharding
from jaxlearn.resilience import nonfinite
from jaxlearn.resilience.manager import Resilience
from jaxlearn.runtime import stack_forms
from jaxlearn.runtime.compute_copy import COPY_KEY, ComputeCopy
from jaxlearn.runtime.input_pipeline import batch_rows
from jaxlearn.runtime.learner import Learner, ema_update, microbatched_grads
from jaxlearn.runtime.objective import Objective
from jaxlearn.runtime.record import RECORD_FILE, RunRecord
from jaxlearn.runtime.rollout import Rollout
from jaxlearn.runtime.step_programs import StepPrograms, trim_to_longest
from jaxlearn.runtime.summary import SummaryWriter, format_flops, format_number
from jaxlearn.runtime.trainer_support import (
    Run,
    RunResult,
    batch_target_weight,
    devices_for,
    dict_keys,
    merge_updates,
    merged_iterator_state,
    peak_flops,
    step_timing,
    untimed_compile,
    warn_if_schedule_changed,
)

log = logging.getLogger("jaxlearn.trainer")

State = dict[str, Any]


class TrainerError(RuntimeError):
    """A training run that cannot start or continue (bad state, bad config combination)."""


class Trainer(Configurable):
    """Trains `model` on `input` with `learner`, checkpointing into `output_dir`."""

    class Config(Configurable.Config, MeshFieldsConfig):
        # Mesh fields (mesh_shape, mesh_axis_names, mesh_axis_rules, mesh_rules,
        # mesh_selector, mesh_rule) come from MeshFieldsConfig; default: pure data parallel.
        mesh_shape: Any = mesh_shape_from_axes(data=-1)
        model: InstantiableConfig = REQUIRED
        input: InstantiableConfig = REQUIRED
        eval_input: Optional[InstantiableConfig] = None
        learner: Learner.Config = Learner.default_config()
        checkpointer: Optional[InstantiableConfig] = None
        summary_writer: SummaryWriter.Config = SummaryWriter.default_config()
        output_dir: str = REQUIRED
        max_step: int = 1000
        seed: int = 0
        log_every_n_steps: int = 10
        eval_every_n_steps: int = 0
        eval_batches: int = 4
        save_every_n_steps: int = 100
        # Steps at which to write a JAX/Perfetto trace (first..last of the list).
        profile_steps: tuple[int, ...] = ()
        # Peak FLOP/s per device for MFU (None: from the hardware catalogue).
        peak_flops_per_device: Optional[float] = None
        # Watchdog, health checks, SDC and non-finite policies, goodput (resilience.py).
        resilience: Resilience.Config = Resilience.default_config()
        # The first params when output_dir has no checkpoint: a `runtime.init_from.
        # ParamSource` config (jaxlearn run, HF dir, GGUF file); None: from `seed`.
        init_from: Optional[InstantiableConfig] = None
        # What the step minimises (`runtime.objective.Objective`); None: the model's forward
        # loss. Post-training objectives (DPO) plug in here.
        objective: Optional[InstantiableConfig] = None
        # Makes each step's batch from the input's rows and the current params (RL's
        # sample-and-score, `runtime.rollout.Rollout`); None: the input's batches are.
        rollout: Optional[InstantiableConfig] = None
        # Cut each batch's sequence axis to its longest row rounded up to this multiple
        # (`step_programs.trim_to_longest`; a program per length); None: full seq_len.
        pad_to_multiple_of: Optional[int] = None

        def _field_problems(self) -> dict[str, str]:
            problems = below_minimum(self, max_step=1, log_every_n_steps=1,
                                     save_every_n_steps=1, eval_every_n_steps=0,
                                     eval_batches=1, profile_steps=1,
                                     pad_to_multiple_of=1)
            if self.peak_flops_per_device is not None and not self.peak_flops_per_device > 0:
                problems["peak_flops_per_device"] = (
                    f"must be > 0 or None, got {self.peak_flops_per_device!r}")
            return problems

    def __init__(self, cfg: "Trainer.Config", *, devices: Optional[Sequence[Any]] = None,
                 run_record: Optional[RunRecord] = None):
        """`devices`: what the mesh is built from (default: this process's view of
        `jax.devices()`); e.g. mock TPU topology devices or fake CPU devices for AOT.
        `run_record`: what built this run (experiment, selector, overrides), written as
        `run.json` into the output dir and every checkpoint; its `config_text` must be this
        config's flat text (default: naming no experiment; `base_model`: init_from's path)."""
        super().__init__(cfg)
        cfg = self.config
        cfg.validate()
        text = to_flat_text(cfg)
        if run_record is None:
            run_record = RunRecord(None, cfg.mesh_selector, (), text)
        elif run_record.config_text != text:
            raise TrainerError("run_record.config_text is not this trainer's config (build the "
                               "record from the final config, after every override)")
        if cfg.init_from is not None and run_record.base_model is None:
            run_record = dataclasses.replace(run_record, base_model=str(cfg.init_from.path))
        self.run_record: RunRecord = run_record
        if devices is None:
            devices = devices_for(cfg.mesh_shape)
        self.mesh: Mesh = mesh_from_config(cfg, devices)
        self.model: Module = cfg.model.clone(name="model").instantiate()
        self.objective: Objective = (cfg.objective or Objective.default_config()).instantiate()
        self.learner: Learner = cfg.learner.instantiate(total_steps=cfg.max_step)
        self.rollout: Optional[Rollout] = cfg.rollout.instantiate() if cfg.rollout else None
        self.param_specs = self.model.create_parameter_specs_recursively()
        self.tx = self.learner.optimizer(self.param_specs)
        self._trainable = self.learner.trainable_mask(self.param_specs)
        self.copy = ComputeCopy(self.model.dtype if cfg.learner.compute_param_copy else None,
                                self.param_specs)
        self._schedule = self.learner.schedule()
        self.param_shardings = jax.tree.map(
            lambda s: self._sharding(s.mesh_axes, s.shape), self.param_specs, is_leaf=is_spec
        )
        self.batch_sharding = self._sharding(("batch", None))
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._check_batch_size()
        self.state_shardings = self._state_shardings()
        # The compiled steps per batch shape, with their non-donating variants.
        self._programs = StepPrograms(self.compile_train_step)
        self._eval_step: Any = None
        self.compiled_flops: Optional[float] = None
        self.mfu_peak = peak_flops(cfg.peak_flops_per_device, list(self.mesh.devices.flat))

    # ---- sharding -------------------------------------------------------------------------

    def _check_batch_size(self) -> None:
        """The global batch must split evenly over the batch mesh axes and microbatches."""
        self.batch_rows = batch = batch_rows(self.config.input)  # Rows of a global batch.
        if not isinstance(batch, int):
            return
        spec = self._spec(("batch",))
        axes = spec[0] if spec and spec[0] is not None else ()
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        shards = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
        micro = self.learner.config.num_microbatches
        if batch % (shards * micro):
            raise TrainerError(f"the global batch's {batch} rows (input.global_batch_size or "
                               f"batch_rows()) must be divisible by the batch shards ({shards}: "
                               f"mesh axes {axes}) x learner.num_microbatches ({micro})")

    def _spec(self, logical_axes: Any, shape: Any = None) -> PartitionSpec:
        return logical_to_partition_spec(
            logical_axes, self.config.mesh_axis_rules, self.mesh, shape=shape
        )

    def _sharding(self, logical_axes: Any, shape: Any = None) -> NamedSharding:
        return NamedSharding(self.mesh, self._spec(logical_axes, shape))

    def _logical(self) -> Any:
        return logical_sharding(self.mesh, self._spec)

    # ---- state ----------------------------------------------------------------------------

    def _init_state(self, seed_key: jax.Array) -> State:
        init_key, train_key = jax.random.split(seed_key)
        return self._state_from_params(
            self.model.initialize_parameters_recursively(init_key), train_key)

    def _state_from_params(self, params: Any, train_key: jax.Array) -> State:
        """The train state around `params`: fresh optimizer state (and EMA), step 0."""
        params = jax.lax.with_sharding_constraint(params, self.param_shardings)
        state: State = {
            "params": params,
            "opt_state": self.tx.init(params),
            "prng_key": train_key,
            "step": jnp.zeros((), jnp.int32),
        }
        if self.learner.config.ema_decay is not None:
            state["ema"] = jax.tree.map(jnp.copy, params)
        return dict(state, **self.copy.state(params))

    def _state_shardings(self) -> State:
        """Params per their specs; every state leaf that mirrors a parameter (Adam's mu/nu,
        EMA, the compute copy, ...) sharded like that parameter, so FSDP divides the whole
        state by N; anything else (PRNG key, step counts, factored statistics) replicated."""
        shapes = jax.eval_shape(self._init_state, jax.random.PRNGKey(0))
        by_path: dict[tuple[str, ...], tuple[Any, NamedSharding]] = {}
        for keypath, spec in jax.tree_util.tree_flatten_with_path(
            self.param_specs, is_leaf=is_spec
        )[0]:
            sharding = self._sharding(spec.mesh_axes, spec.shape)
            by_path[dict_keys(keypath)] = (tuple(spec.shape), sharding)

        def opt_leaf(keypath: Any, leaf: Any) -> NamedSharding:
            names = dict_keys(keypath)
            for start in range(len(names)):
                hit = by_path.get(names[start:])
                if hit is not None and hit[0] == tuple(leaf.shape):
                    return hit[1]
            return self._replicated

        return dict(jax.tree_util.tree_map_with_path(opt_leaf, shapes))

    def init_state(self) -> State:
        """Fresh sharded state for `config.seed` (bit-identical for the same seed); with
        `init_from`, around its params loaded straight into the param shardings."""
        key = jax.random.PRNGKey(self.config.seed)
        with jax.set_mesh(self.mesh):
            if self.config.init_from is None:
                return jax.jit(self._init_state, out_shardings=self.state_shardings)(key)
            from jaxlearn.runtime.init_from import load_params

            init_key, train_key = jax.random.split(key)
            params = load_params(self.config.init_from, self.model, self.param_specs,
                                 self.param_shardings, init_key)
            fn = jax.jit(self._state_from_params, out_shardings=self.state_shardings,
                         donate_argnums=(0,))  # The loaded params become the state's.
            return fn(params, train_key)

    def abstract_state(self, *, derived: bool = False) -> State:
        """ShapeDtypeStructs with shardings of the checkpointed state (the restore target);
        `derived=True`: of the whole state the step runs on (+ the compute copy), what AOT
        compiles for."""
        shapes = jax.eval_shape(self._init_state, jax.random.PRNGKey(0))
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             shapes, self.state_shardings)
        return state if derived else self.copy.checkpointed(state)

    # ---- the step -------------------------------------------------------------------------

    def _loss(self, params: Any, batch: Any, key: jax.Array,
              reference: Any = None) -> tuple[jax.Array, Any]:
        loss, metrics, collection = self.objective(self.model, params, batch, key,
                                                   is_training=True, reference=reference)
        return loss, (metrics, collection)

    def _grads(self, state: State, batch: Any, key: jax.Array) -> tuple[Any, ...]:
        """(loss, metrics, state updates, grads), microbatched; the forward reads the
        compute copy when the state has one (grads are the masters')."""
        def loss(p: Any, b: Any, k: jax.Array) -> tuple[jax.Array, Any]:
            p = self.learner.stop_frozen(self.copy.forward(p, state), self._trainable)
            return self._loss(p, b, k, state.get("ema"))

        grad_fn = jax.value_and_grad(loss, has_aux=True)
        return microbatched_grads(grad_fn, state["params"], batch, key,
                                  self.learner.config.num_microbatches)

    def _step(self, state: State, batch: Any) -> tuple[State, dict[str, jax.Array]]:
        key, step_key = jax.random.split(state["prng_key"])
        loss, metrics, state_updates, grads = self._grads(state, batch, step_key)
        kept: list[str] = [k for k in ("params", "opt_state", "ema", COPY_KEY) if k in state]

        def update(old: dict[str, Any]) -> dict[str, Any]:
            updates, opt_state = self.tx.update(grads, old["opt_state"], old["params"])
            params = optax.apply_updates(old["params"], updates)
            new = {"params": merge_updates(params, state_updates), "opt_state": opt_state}
            new.update(self.copy.state(new["params"], old.get(COPY_KEY), self._trainable))
            if "ema" in old:
                new["ema"] = ema_update(old["ema"], new["params"],
                                        self.learner.config.ema_decay)
            return new

        summaries = {
            "loss": loss,
            "grad_norm": optax.tree.norm(self.learner.trained_leaves(grads, self._trainable)),
            "learning_rate": self._schedule(state["step"]),
            **{k: v for k, v in metrics.items() if jnp.ndim(v) == 0},
        }
        old = {k: state[k] for k in kept}
        if self.config.resilience.nonfinite != "off":
            # NaN/Inf anywhere: keep params, optimizer state and EMA (the step advances).
            # A cond, not `where(ok, new, old)` per leaf: with the select, XLA copies every
            # donated optimizer-state buffer each step (~465 MB for a 58M-param AdamW
            # state, ~5% of a CPU step) to keep `old` alive next to the in-place update.
            flags = nonfinite.step_flags(loss, grads)
            new = jax.lax.cond(jnp.all(flags), update, lambda o: o, old)
            summaries[nonfinite.FLAGS_KEY] = flags
        else:
            new = update(old)
        new_state = dict(state, **new, prng_key=key, step=state["step"] + 1)
        return new_state, summaries

    def compile_train_step(self, batch_abstract: Any, *, donate: bool = True) -> Any:
        """AOT-compiles the train step for the abstract state and batch. `donate=False`:
        the same computation without donating the input state (its buffers stay valid,
        e.g. while a checkpoint of it is still being copied to host)."""
        fn = jax.jit(
            self._step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, self._replicated),
            donate_argnums=(0,) if donate else (),
        )
        state = self.abstract_state(derived=True)  # Outside the mesh: may have no devices.
        with jax.set_mesh(self.mesh), self._logical():
            return fn.lower(state, batch_abstract).compile()

    def _eval(self, params: Any, batch: Any) -> dict[str, jax.Array]:
        loss, metrics, _ = self.objective(self.model, params, batch, None, is_training=False)
        return {"loss": loss, **{k: v for k, v in metrics.items() if jnp.ndim(v) == 0}}

    # ---- data -----------------------------------------------------------------------------

    def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Per-process numpy batch -> global arrays sharded over the batch axes."""
        return {
            k: jax.make_array_from_process_local_data(
                self._sharding(("batch",) + (None,) * (v.ndim - 1)), v
            )
            for k, v in local.items()
        }

    # ---- the loop: setup, restore, steps, finish ------------------------------------------

    def run(self) -> RunResult:
        """Trains to `max_step` (resuming from the newest good checkpoint); returns the final
        state, step, last scalars and the guard. Nothing is written before the restore
        succeeded."""
        cfg = self.config
        storage.resolve(cfg.output_dir)  # A URI's backend, credentials, bucket: StorageError.
        local_dir = storage.local_dir(cfg.output_dir)  # Hang dumps, goodput, profiles.
        os.makedirs(local_dir, exist_ok=True)
        is_main = jax.process_index() == 0
        run = Run(is_main, cfg.resilience.instantiate(
            output_dir=local_dir, is_main=is_main,
            param_paths=nonfinite.leaf_paths(self.param_specs, is_leaf=is_spec)))
        try:
            self._setup(run)
            self._start_outputs(run)
            run.guard.loop_started(run.step)
            run.t_last = time.monotonic()  # Step times start with the loop, not the setup.
            while run.step < cfg.max_step:
                self._train_step_once(run)
                self._after_step(run)
                if run.guard.stop_requested(run.step):  # SIGTERM/SIGINT, on any process.
                    self._stop_preempted(run)  # Raises Preempted.
            self._finish(run)
        finally:
            self._close(run)
        return RunResult(state=run.state, step=run.step, metrics=run.last, resilience=run.guard)

    def _setup(self, run: Run) -> None:
        """Health checks and watchdog, the input iterator, the checkpointer, and the restored
        (or freshly initialized) state."""
        cfg = self.config
        run.guard.start(list(self.mesh.devices.flat))
        data = cfg.input.instantiate()
        run.data = data.iterator(jax.process_index(), jax.process_count())
        if self.rollout is not None:
            self.rollout.bind(model_cfg=cfg.model, input=data, trainable=self._trainable,
                              process_index=jax.process_index(),
                              process_count=jax.process_count())
        if cfg.checkpointer is not None:
            directory = storage.join(cfg.output_dir, "checkpoints")
            run.checkpointer = cfg.checkpointer.clone(directory=directory).instantiate()
        with run.guard.span("restore"):
            run.state, run.step = self._restore_or_init(run.checkpointer, run.data)

    def _start_outputs(self, run: Run) -> None:
        """The summary writer, `config.txt` and `run.json` (process 0), the start lines."""
        cfg = self.config
        peak = self.mfu_peak
        run.writer = cfg.summary_writer.instantiate(
            output_dir=cfg.output_dir, max_step=cfg.max_step, enabled=run.is_main,
            mfu_peak=None if peak is None else peak[1], resumed_at=run.step)
        warn_if_schedule_changed(run.checkpointer, run.step, cfg.max_step,
                                 self.learner.config.total_steps)
        if run.is_main:
            storage.write_text(storage.join(cfg.output_dir, "config.txt"),
                               self.run_record.config_text)
            self.run_record.write(cfg.output_dir)
        count = self.parameter_count()
        run.writer.info(f"model: {count:,} parameters ({format_number(count)})"
                        + (f", from step {run.step}" if run.step else ""))

    def _train_step_once(self, run: Run) -> None:
        """One step: profiler start/stop, the batch, compilation (first step), the update."""
        cfg, guard = self.config, run.guard
        if cfg.profile_steps and run.step == min(cfg.profile_steps) and run.is_main:
            jax.profiler.start_trace(storage.join(storage.local_dir(cfg.output_dir), "profile"),
                                     create_perfetto_trace=True)
            run.profiling = True
        local = self._next_batch(run)
        with guard.span("data"):
            if cfg.pad_to_multiple_of:
                local = trim_to_longest(local, cfg.pad_to_multiple_of)
            local = guard.before_step(run.step + 1, local)
            if batch_target_weight(local) == 0.0:  # Loss 0, nothing learned: say so.
                raise TrainerError(
                    f"step {run.step + 1}: the batch has no trained target (its "
                    "target_weights sum to 0), so the step would report loss 0 and learn "
                    "nothing; check the input (e.g. fine-tuning rows truncated to nothing)")
            batch = self.global_batch(local)
        run.tokens_per_step = int(np.prod(batch["input_ids"].shape))
        found = self._programs.get(batch)
        if found is None:  # A new batch shape: compile its step.
            first_save = (run.step // cfg.save_every_n_steps + 1) * cfg.save_every_n_steps
            with untimed_compile(run):
                found = self._programs.compile(batch, keep_later=(
                    run.checkpointer is not None and first_save < cfg.max_step))
            self.compiled_flops = found[1]
            if len(self._programs) == 1:
                self._report_flops(run)
        step_fn, self.compiled_flops = found
        if run.keep_input:  # The previous step's state is being saved: do not donate it.
            with untimed_compile(run):
                step_fn = self._keep_step_fn(batch)
            run.keep_input = False
        with jax.set_mesh(self.mesh):
            run.state, summaries = guard.train_step(step_fn, run.state, batch, run.step + 1)
        run.step += 1
        run.steps_since += 1
        run.state, run.summaries = guard.after_step(run.step, run.state, summaries)
        if run.profiling and run.step > max(cfg.profile_steps):
            jax.block_until_ready(run.state)
            jax.profiler.stop_trace()
            run.profiling = False

    def _next_batch(self, run: Run) -> dict[str, np.ndarray]:
        """The input's next batch, or (RL) the rollout's batch of the input's next rows."""
        with run.guard.span("data"):
            local = next(run.data)
        if self.rollout is None:
            return local
        t0 = time.monotonic()
        with run.guard.span("rollout", step=run.step + 1, wait_for=run.state):
            local, run.rollout_scalars = self.rollout(local, run.state["params"], run.step + 1)
        run.rollout_s += time.monotonic() - t0
        return local

    def _after_step(self, run: Run) -> None:
        """Logging, evaluation and checkpointing, each when due at `run.step`."""
        cfg, step, writer = self.config, run.step, run.writer
        if step % cfg.log_every_n_steps == 0 or step == cfg.max_step or step == 1:
            scalars = {k: float(v) for k, v in jax.device_get(run.summaries).items()}
            scalars.update(run.rollout_scalars)
            scalars.update(step_timing(run, self.compiled_flops, self.mfu_peak))
            run.last = writer.write(step, scalars)
            writer.progress(step, run.last)
            run.guard.log(step, run.last, writer)
        if cfg.eval_input is not None and cfg.eval_every_n_steps and (
            step % cfg.eval_every_n_steps == 0 or step == cfg.max_step
        ):
            with run.guard.span("eval", step=step, wait_for=run.state):
                ev = self.evaluate(run.state["params"])
            writer.write(step, ev, prefix="eval")
            writer.evaluation(step, ev)
            run.last.update({f"eval_{k}": v for k, v in ev.items()})
        if run.checkpointer is not None and (
            step % cfg.save_every_n_steps == 0 or step == cfg.max_step
        ):
            self._save(run)

    def _save(self, run: Run) -> None:
        """Saves `run.state` at `run.step`. snapshot=False: the next step does not donate
        `state` (`keep_input`), so the checkpointer copies it to host in the background."""
        if run.writer is not None:  # No step is committed without its metrics (object stores).
            run.writer.flush()
        saved = run.guard.save(
            run.checkpointer, run.step, self.copy.checkpointed(run.state),
            data_iterator_state=run.data.get_state(), config_text=self.run_record.config_text,
            metrics=run.last, snapshot=False,
            extra_files={RECORD_FILE: self.run_record.to_json().encode()})
        run.state = self.copy.attach(saved, self.state_shardings, run.state)
        run.keep_input = True

    def _stop_preempted(self, run: Run) -> None:
        """A preemption signal reached some process: every process saves this step (unless
        `_after_step` just did) and waits for the commit; raises Preempted (status 46)."""
        run.guard.finish()
        if run.checkpointer is not None and not run.keep_input:
            run.guard.preemption.saving = f"while saving step {run.step}"
            self._save(run)
        run.checkpointer, pending = None, run.checkpointer
        run.guard.preempted(pending, run.step)

    def _finish(self, run: Run) -> None:
        """A normal end: the last non-finite flags, then the last commit."""
        run.guard.finish()
        if run.checkpointer is not None:
            run.checkpointer, pending = None, run.checkpointer
            run.guard.finish_saves(pending)

    def _close(self, run: Run) -> None:
        """Always runs: stops the profiler, the checkpointer (on an error in flight, without
        masking it), the writer and the resilience hooks."""
        if run.profiling:
            jax.profiler.stop_trace()
        if run.checkpointer is not None:  # An error is in flight: do not mask it.
            try:
                run.checkpointer.wait_until_finished()
                run.checkpointer.close()
            except Exception as e:
                log.error("while stopping on an error, the last checkpoint save failed "
                          "too: %s", e)
        if run.writer is not None:
            run.writer.close()
        self._programs.join()  # No compilation outlives the run.
        run.guard.close()

    def parameter_count(self) -> int:
        """Number of model parameters (scalars), from the parameter specs."""
        leaves = jax.tree.leaves(self.param_specs, is_leaf=is_spec)
        return int(sum(int(np.prod(s.shape)) for s in leaves))

    def _report_flops(self, run: Run) -> None:
        """The start line about compute: FLOPs per token of the compiled step, and the peak
        MFU is measured against."""
        if not self.compiled_flops or not run.tokens_per_step:
            return
        per_token = self.compiled_flops * self.mesh.devices.size / run.tokens_per_step
        peak = self.mfu_peak
        run.writer.info(
            f"train step: {format_flops(per_token)}/token (compiled forward, backward and "
            f"update; {format_flops(self.compiled_flops)} per device per step)"
            + (f"; MFU is measured against {peak[1]}" if peak else ""))

    def _keep_step_fn(self, batch: Any) -> Any:
        """The non-donating step (waits for its compilation if still running)."""
        try:
            return self._programs.keep(batch)
        except Exception as e:
            raise TrainerError(f"compiling the non-donating train step failed: {e}") from e

    def evaluate(self, params: Any) -> dict[str, float]:
        """Mean loss/metrics over `eval_batches` batches of `eval_input`, and perplexity."""
        cfg = self.config
        assert cfg.eval_input is not None
        if self._eval_step is None:
            self._eval_step = jax.jit(self._eval)
        data = cfg.eval_input.instantiate().iterator(jax.process_index(), jax.process_count())
        totals: dict[str, float] = {}
        for _ in range(cfg.eval_batches):
            with jax.set_mesh(self.mesh), self._logical():
                out = jax.device_get(self._eval_step(params, self.global_batch(next(data))))
            for k, v in out.items():
                totals[k] = totals.get(k, 0.0) + float(v) / cfg.eval_batches
        totals["perplexity"] = float(np.exp(min(totals["loss"], 50.0)))
        return totals

    def _restore_or_init(self, checkpointer: Any, data: Any) -> tuple[State, int]:
        if checkpointer is not None:
            # Leaves the step lacks may be saved under the model's older param names
            # (params, EMA and the optimizer state alike).
            # A step with a layer stack in its other form is laid out as this model's.
            restored = stack_forms.restore_latest(
                checkpointer, self.abstract_state(),
                aliases=getattr(self.model, "older_param_path", None))
            if restored is not None:
                step, state = restored
                meta = checkpointer.read_metadata(step, process_index=jax.process_index())
                iterator_state = meta.data_iterator_state
                if meta.process_count != jax.process_count():
                    iterator_state = merged_iterator_state(checkpointer, step, meta.process_count)
                if iterator_state is not None:
                    data.set_state(iterator_state)
                # Newer step dirs failed verification: move them aside so that those
                # step numbers can be saved again.
                skipped = checkpointer.quarantine_newer_than(step)
                if skipped:
                    log.warning("resumed from step %d: newer step(s) failed verification "
                                "(see above) and were moved aside: %s", step,
                                ", ".join(p.name for p in skipped))
                else:
                    log.info("resumed from step %d", step)
                return self.copy.attach(state, self.state_shardings), int(step)
        return self.init_state(), 0
