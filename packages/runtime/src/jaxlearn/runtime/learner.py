"""The learner: an optax optimizer built from config, plus per-parameter rules.

    tx = Learner.default_config().set(optimizer="adamw", learning_rate=3e-4).instantiate(
        total_steps=1000).optimizer(param_specs)

Chain (all optax): clip_by_global_norm -> scale_by_{adam,lion,factored_rms} ->
add_decayed_weights (scaled per parameter by its spec's `weight_decay_scale`; norms and
biases default to 0) -> scale_by_learning_rate(warmup + cosine/linear schedule) ->
per-path rules by regex (freeze, or scale the update). With uniform decay and no rules it
is exactly `optax.adamw`. `fused=True` (adamw) runs clipping through the learning rate as
one elementwise pass per parameter (`fused_adamw`).

`trainable` (a path regex) trains a subset, e.g. LoRA adapters: the whole chain above
(clipping included) runs on the matching parameters only, and the others get a zero
update and no optimizer state (`optax.multi_transform` with `optax.set_to_zero`), so
Adam's moments take 2x the trainable bytes, not 2x the model. The trainer reads the others
behind `stop_gradient` (`trainable_mask`, `stop_frozen`), so the backward computes no
gradient it would throw away (a tied embedding's dW is a third of a LoRA step's LM head),
and `grad_norm` is the trained parameters' norm, the one clipping uses. A "freeze" update rule, by
contrast, zeroes the update at the end of the chain and keeps the moments.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxlearn.config import ConfigError, Configurable
from jaxlearn.module import flatten_specs, is_spec, keypath_str


class Learner(Configurable):
    """Optimizer, schedule, clipping, weight decay, per-path rules, microbatching, EMA."""

    class Config(Configurable.Config):
        optimizer: str = "adamw"  # adamw | lion | adafactor | sgd
        learning_rate: float = 3e-4
        b1: float = 0.9
        b2: float = 0.95
        eps: float = 1e-8
        weight_decay: float = 0.1
        schedule: str = "cosine"  # constant | cosine | linear
        warmup_steps: int = 0
        # Schedule length; None: the trainer's max_step.
        total_steps: Optional[int] = None
        # Final learning rate as a fraction of the peak (cosine / linear).
        end_lr_fraction: float = 0.1
        max_grad_norm: Optional[float] = 1.0
        # Gradient accumulation: the global batch is split into this many microbatches.
        num_microbatches: int = 1
        # (path regex, "freeze" | scale) applied to updates; first full match wins.
        update_rules: list[tuple[str, Any]] = []
        # Path regex ("decoder/.../q_proj/adapter/lora_a"): only fully matching parameters are
        # trained and have optimizer state; None: all of them.
        trainable: Optional[str] = None
        # Keep an exponential moving average of parameters with this decay (None: off).
        ema_decay: Optional[float] = None
        # adamw only: clipping, Adam, weight decay and the learning rate as one elementwise
        # pass per parameter (`fused_adamw`, same math as the chain). Off by default: the
        # update alone runs 1.3x faster, the whole train step does not (inside the jitted
        # step XLA already fuses the chain). Its state is one `optax.ScaleByAdamState`
        # (checkpoints of the chain's state do not restore into it).
        fused: bool = False
        # Keep the matmul weights in the model's compute dtype (bf16) between steps, made
        # once per update inside the step, and run the forward/backward on that copy; the
        # optimizer keeps the f32 masters (`runtime.compute_copy`; not checkpointed). A
        # no-op when the model computes in its parameters' dtype. Off by default: the
        # 2-layer bf16 step measured no faster (0.94x its CPU time), for +2 B per weight.
        compute_param_copy: bool = False

    def __init__(self, cfg: "Learner.Config", *, total_steps: Optional[int] = None):
        super().__init__(cfg)
        self._total_steps = cfg.total_steps or total_steps or 1
        if cfg.num_microbatches < 1:
            raise ConfigError(f"learner.num_microbatches must be >= 1, got {cfg.num_microbatches}")
        for pattern, rule in cfg.update_rules:
            if rule != "freeze" and not isinstance(rule, (int, float)):
                raise ConfigError(f"learner.update_rules: rule for {pattern!r} must be "
                                  f"'freeze' or a number, got {rule!r}")
        if cfg.trainable is not None:
            try:
                re.compile(cfg.trainable)
            except re.error as e:
                raise ConfigError(f"learner.trainable: bad regex {cfg.trainable!r}: {e}") from None

    def trainable_mask(self, param_specs: Any) -> Optional[Any]:
        """A tree like `param_specs` with True where `trainable` fully matches the
        parameter's "/"-joined path; None when every parameter trains."""
        if self.config.trainable is None:
            return None
        return jax.tree_util.tree_map_with_path(
            lambda kp, _: self._trains(keypath_str(kp)), param_specs, is_leaf=is_spec)

    def _trains(self, path: str) -> bool:
        """Whether `trainable` selects the parameter at "/"-joined `path` (set)."""
        assert self.config.trainable is not None
        return re.fullmatch(self.config.trainable, path) is not None

    @staticmethod
    def stop_frozen(params: Any, mask: Optional[Any]) -> Any:
        """`params` with every leaf `mask` marks False behind `lax.stop_gradient` (its gradient
        is zero and costs nothing); `params` itself when `mask` is None."""
        if mask is None:
            return params
        return jax.tree.map(lambda keep, p: p if keep else lax.stop_gradient(p), mask, params)

    @staticmethod
    def trained_leaves(tree: Any, mask: Optional[Any]) -> list[Any]:
        """The leaves of a params-like `tree` that `mask` marks True (all when None)."""
        if mask is None:
            return jax.tree.leaves(tree)
        return [x for keep, x in zip(jax.tree.leaves(mask), jax.tree.leaves(tree)) if keep]

    def schedule(self) -> optax.Schedule:
        cfg = self.config
        peak, warm = cfg.learning_rate, cfg.warmup_steps
        decay_steps = max(self._total_steps - warm, 1)
        end = peak * cfg.end_lr_fraction
        if cfg.schedule == "constant":
            main: optax.Schedule = optax.constant_schedule(peak)
        elif cfg.schedule == "cosine":
            main = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.end_lr_fraction)
        elif cfg.schedule == "linear":
            main = optax.linear_schedule(peak, end, decay_steps)
        else:
            raise ConfigError(f"learner.schedule: unknown {cfg.schedule!r} "
                              f"(constant | cosine | linear)")
        if warm <= 0:
            return main
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), main], [warm])

    def _scale_transform(self) -> optax.GradientTransformation:
        cfg = self.config
        if cfg.optimizer == "adamw":
            return optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
        if cfg.optimizer == "lion":
            return optax.scale_by_lion(b1=cfg.b1, b2=cfg.b2)
        if cfg.optimizer == "adafactor":
            return optax.scale_by_factored_rms()
        if cfg.optimizer == "sgd":
            return optax.identity()
        raise ConfigError(f"learner.optimizer: unknown {cfg.optimizer!r} "
                          f"(adamw | lion | adafactor | sgd)")

    def optimizer(self, param_specs: Any) -> optax.GradientTransformation:
        """The optax transformation for parameters described by `param_specs`."""
        cfg = self.config
        parts = []
        if cfg.fused and cfg.optimizer == "adamw":
            parts.append(fused_adamw(
                self.schedule(), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                decay_scales=_decay_scales(param_specs),
            ))
        elif cfg.max_grad_norm:
            parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
        if not (cfg.fused and cfg.optimizer == "adamw"):
            parts.append(self._scale_transform())
            if cfg.weight_decay:
                parts.append(_decay_by_spec(cfg.weight_decay, param_specs))
            parts.append(optax.scale_by_learning_rate(self.schedule()))
        if cfg.update_rules:
            parts.append(_update_rules(cfg.update_rules, param_specs))
        chain = optax.chain(*parts)
        if cfg.trainable is None:
            return chain
        names, labels = _labels(
            param_specs,
            lambda path, spec: "train" if self._trains(path) else "frozen",
        )
        if "train" not in names:
            raise ConfigError(f"learner.trainable: {cfg.trainable!r} matches no parameter "
                              f"(paths look like {flatten_specs(param_specs)[0][0]!r})")
        return optax.multi_transform({"train": chain, "frozen": optax.set_to_zero()}, labels)


def microbatched_grads(grad_fn: Any, params: Any, batch: Any, key: jax.Array,
                       num_microbatches: int) -> tuple[Any, Any, Any, Any]:
    """(loss, metrics, state updates, grads) of `grad_fn(params, batch, key) -> ((loss,
    (metrics, collection)), grads)` over `num_microbatches` slices of the batch, each
    weighted by its share of target tokens, so the result equals one step on the whole
    batch (for token-mean losses). Gradients accumulate in the params' dtypes."""
    n = num_microbatches
    if n == 1:
        (loss, (metrics, collection)), grads = grad_fn(params, batch, key)
        return loss, metrics, collection.state_updates, grads
    micro = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)
    if "target_weights" in batch:
        counts = micro["target_weights"].reshape(n, -1).sum(axis=1)
    else:
        counts = jnp.ones((n,), jnp.float32)
    shares = counts / jnp.maximum(counts.sum(), 1e-9)
    keys = jax.random.split(key, n)

    def body(acc: Any, inp: Any) -> tuple[Any, Any]:
        mb, k, share = inp
        (loss, (metrics, collection)), grads = grad_fn(params, mb, k)
        acc = jax.tree.map(lambda a, g: a + share * g, acc, grads)
        return acc, (loss * share, metrics, collection.state_updates)

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, (losses, metrics, updates) = lax.scan(body, zeros, (micro, keys, shares))
    metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
    updates = jax.tree.map(lambda u: u[-1], updates)
    return losses.sum(), metrics, updates, grads


def _labels(specs: Any, label_fn: Any) -> tuple[set[str], Any]:
    """(every label, labels(tree)): `label_fn(path, spec)` for each leaf of a params-like
    tree, found by its "/"-joined path; the tree may be masked (a `trainable` subset)."""
    by_path = dict(flatten_specs(specs))

    def labels(tree: Any) -> Any:
        def one(keypath: Any, _: Any) -> str:
            path = keypath_str(keypath)
            return str(label_fn(path, by_path[path]))

        return jax.tree_util.tree_map_with_path(one, tree)

    return {label_fn(path, spec) for path, spec in by_path.items()}, labels


def _decay_by_spec(weight_decay: float, specs: Any) -> optax.GradientTransformation:
    names, labels = _labels(specs, lambda path, spec: f"wd_{spec.weight_decay_scale!r}")
    transforms = {
        label: optax.add_decayed_weights(weight_decay * float(label[3:])) for label in names
    }
    return optax.multi_transform(transforms, labels)


def _update_rules(rules: list, specs: Any) -> optax.GradientTransformation:
    def label(path: str, spec: Any) -> str:
        for pattern, rule in rules:
            if re.fullmatch(pattern, path):
                return "freeze" if rule == "freeze" else f"scale_{float(rule)!r}"
        return "keep"

    names, labels = _labels(specs, label)
    transforms: dict[str, optax.GradientTransformation] = {}
    for name in names:
        if name == "freeze":
            transforms[name] = optax.set_to_zero()
        elif name == "keep":
            transforms[name] = optax.identity()
        else:
            transforms[name] = optax.scale(float(name[6:]))
    return optax.multi_transform(transforms, labels)


def _decay_scales(specs: Any) -> Any:
    """tree -> the same tree of each leaf's spec `weight_decay_scale` (by path)."""
    by_path = dict(flatten_specs(specs))

    def scales(tree: Any) -> Any:
        def one(keypath: Any, _: Any) -> float:
            path = keypath_str(keypath)
            return float(by_path[path].weight_decay_scale)

        return jax.tree_util.tree_map_with_path(one, tree)

    return scales


def fused_adamw(
    learning_rate: optax.Schedule,
    *,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    max_grad_norm: Optional[float],
    decay_scales: Any,
) -> optax.GradientTransformation:
    """clip_by_global_norm -> scale_by_adam -> add_decayed_weights (times each leaf's
    `decay_scales(tree)` entry) -> scale_by_learning_rate, as one elementwise function per
    leaf: XLA fuses it into a single loop over (grad, mu, nu, param) per parameter. The
    state is `optax.ScaleByAdamState(count, mu, nu)`; the learning rate is
    `learning_rate(count)` before the increment (as optax's chain)."""

    def init(params: Any) -> optax.ScaleByAdamState:
        mu = jax.tree.map(jnp.zeros_like, params)
        nu = jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(jnp.zeros((), jnp.int32), mu, nu)

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("fused_adamw: update needs params (weight decay)")
        norm = optax.tree.norm(grads) if max_grad_norm else None
        count = optax.safe_increment(state.count)
        c1 = 1.0 - b1 ** count.astype(jnp.float32)
        c2 = 1.0 - b2 ** count.astype(jnp.float32)
        lr = learning_rate(state.count)

        def one(g: Any, m: Any, v: Any, p: Any, wd: float) -> tuple[Any, Any, Any]:
            if norm is not None:  # optax.clip_by_global_norm's exact form.
                g = lax.select(norm < max_grad_norm, g, (g / norm.astype(g.dtype)) * max_grad_norm)
            m = b1 * m + (1.0 - b1) * g
            v = b2 * v + (1.0 - b2) * jnp.square(g)
            u = (m / c1) / (jnp.sqrt(v / c2) + eps)
            if weight_decay * wd:
                u = u + weight_decay * wd * p
            return (-lr * u).astype(p.dtype), m, v

        out = jax.tree.map(one, grads, state.mu, state.nu, params, decay_scales(params))
        outer, inner = jax.tree.structure(grads), jax.tree.structure((0, 0, 0))
        updates, mu, nu = jax.tree.transpose(outer, inner, out)
        return updates, optax.ScaleByAdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def ema_update(ema: Any, params: Any, decay: float) -> Any:
    """EMA of parameters: decay * ema + (1 - decay) * params (optax.incremental_update)."""
    return optax.incremental_update(params, ema, step_size=1.0 - decay)
