"""Does a training config fit its target's accelerator memory? The check `jaxlearn launch
slurm|k8s` runs before it writes a job (`--no_fit_check` skips it, `--force` warns and goes on).

    verdict = check_fit(config_text, "gpu-h100-8x4", cache_dir=...)   # Verdict
    verdict.fits, verdict.describe()

Per device, against `hbm_utilization` (0.95) x the target's HBM (jaxlearn.mesh catalogue):

- the floor (default; about 20 s for a 7B model, no compile): the sharded state's exact
  per-device bytes (params and optimizer state with the trainer's shardings, built by
  `jaxlearn.aot.build_trainer` on a fake CPU mesh of the target's size), plus gradients
  (one more params shard), plus the activations the backward pass keeps (`activation_bytes`:
  from the config's layers, widths, per-device tokens and remat policy). It leaves out
  every temporary, so a config over the floor cannot fit, while one under it may still not;
- compiled (`aot=True`, `--aot_check`): the per-device requirement of the compiled train
  step (`aot_compile`; minutes for a 7B model on a CPU).

Both run in a subprocess (`python -m jaxlearn.aot.fit --config FILE --mesh_selector S
[--compile]`: the fake device count must be set before JAX starts; the config travels as
its flat text) and are cached as JSON in `cache_dir`, keyed by the config's
`matrix.config_digest` (output paths left out), the method and the JAX version. A check
that cannot run is reported (fits None), never a refusal.

Before either, a fresh AOT matrix entry (`matrix_entry`: the compiled verdict recorded by
`tools/aot_matrix.sh`) answers at once with the compiled figure (`from_matrix`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

import jax

from jaxlearn.aot.compile import aot_compile, build_trainer
from jaxlearn.aot.estimate import find_int_field
from jaxlearn.aot.matrix import config_digest
from jaxlearn.aot.report import human_bytes, state_breakdown
from jaxlearn.aot.target import resolve_target
from jaxlearn.config import from_flat_text
from jaxlearn.mesh import selector_num_devices

GiB = 2**30
HBM_UTILIZATION = 0.95
# remat policies that keep the outputs of the layer's matmuls for the backward pass.
_KEEPS_DOTS = re.compile(r"(checkpoint_)?dots.*")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the check found (bytes per device).

    Attributes:
        method: "floor", "aot" or "aot matrix" (a fresh recorded compile).
        fits: whether `required_bytes` <= `usable_bytes` (None: the check could not run).
        required_bytes: the floor or the compiled requirement.
        usable_bytes: hbm_utilization x HBM.
        hbm_bytes: the target's HBM per device.
        parts: what the floor is made of ({"state": ..., "gradients": ..., ...}).
        error: why the check could not run.
    """

    method: str
    fits: Optional[bool]
    required_bytes: int = 0
    usable_bytes: int = 0
    hbm_bytes: int = 0
    parts: tuple[tuple[str, int], ...] = ()
    error: Optional[str] = None

    def describe(self) -> str:
        """'at least 376.60 GiB per device (state 9.41 GiB, ...) of 76.00 GiB usable ...'."""
        if self.error:
            return f"could not check the fit ({self.error})"
        what = {"floor": "at least", "aot": "the compiled step needs",
                "aot matrix": "the compiled step (AOT matrix) needs"}[self.method]
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in self.parts)
        return (f"{what} {human_bytes(self.required_bytes)} per device"
                + (f" ({parts})" if parts else "")
                + f" of {human_bytes(self.usable_bytes)} usable ({HBM_UTILIZATION:g} x "
                f"{human_bytes(self.hbm_bytes)} HBM)")


# ---- the floor, in the subprocess ----------------------------------------------------------


def activation_bytes(cfg: Any, tokens: int, model_shards: int) -> int:
    """Bytes the backward pass keeps of a transformer stack's activations, per device,
    for `tokens` tokens per device and the heads/MLP split `model_shards` ways.

    Per layer and token: the layer's input (every remat policy keeps it); with a dots
    policy, or no remat, the matmul outputs too (q, k, v, attention output, MLP inputs and
    output); with no remat and einsum attention, the attention weights (heads x seq). 0
    when the config has no stack of `num_layers` layers with `self_attention`."""
    stack = find_int_field(cfg, "num_layers")
    layer = getattr(stack, "layer", None)
    attn, ffn = getattr(layer, "self_attention", None), getattr(layer, "feed_forward", None)
    dim = getattr(find_int_field(cfg, "dim"), "dim", None)
    if stack is None or attn is None or ffn is None or not isinstance(dim, int):
        return 0
    head_dim = attn.head_dim or dim // attn.num_heads
    q, kv = attn.num_heads * head_dim, (attn.num_kv_heads or attn.num_heads) * head_dim
    mlp = ffn.hidden_dim * len(ffn.activation if isinstance(ffn.activation, tuple) else (1,))
    spec = getattr(layer, "remat_spec", None)
    policy = None if spec is None else str(getattr(spec, "policy", spec))
    per_token = dim  # The layer's input.
    if policy is None or _KEEPS_DOTS.fullmatch(policy):
        per_token += (q + 2 * kv + mlp) // model_shards + 2 * dim
    seq = cfg.input.seq_len
    if policy is None and attn.implementation_at(seq) == "einsum":
        per_token += attn.num_heads // max(1, model_shards) * seq
    dtype_bytes = 4 if str(getattr(cfg.model, "dtype", "")) == "float32" else 2
    return int(stack.num_layers * tokens * per_token * dtype_bytes)


def floor(cfg: Any, selector: str) -> dict[str, Any]:
    """The floor's figures of `cfg` on `selector` (run where JAX has the target's number of
    CPU devices)."""
    target = resolve_target(selector, topology="fake")
    trainer = build_trainer(cfg, target)
    state = state_breakdown(trainer.abstract_state(derived=True))
    batch, seq = trainer.batch_rows, cfg.input.seq_len  # Rows, not examples (GRPO).
    per_device_batch = trainer.batch_sharding.shard_shape((batch, seq))[0]
    tokens = per_device_batch * seq // trainer.mesh.shape.get("seq", 1)
    tokens //= trainer.learner.config.num_microbatches
    parts = {"state": sum(state.values()), "gradients": state.get("params", 0),
             "activations kept for the backward pass":
                 activation_bytes(cfg, tokens, trainer.mesh.shape.get("model", 1))}
    return {"required_bytes": sum(parts.values()), "hbm_bytes": target.hbm_bytes,
            "parts": list(parts.items())}


def compiled(cfg: Any, selector: str) -> dict[str, Any]:
    """The compiled train step's figures of `cfg` on `selector` (same setting as `floor`)."""
    report = aot_compile(cfg, resolve_target(selector, topology="fake"),
                         hbm_utilization=HBM_UTILIZATION)
    step = json.loads(json.dumps(report.to_dict(), default=str))["steps"]["train_step"]
    return {"required_bytes": step["required_bytes"], "hbm_bytes": step["hbm_bytes"],
            "parts": [["temporaries", step["temp_bytes"]], ["arguments", step["argument_bytes"]]]}


# ---- running and caching -------------------------------------------------------------------


def _cache_path(cache_dir: str, digest: str, method: str) -> str:
    key = hashlib.sha256(f"{digest}\n{method}\n{jax.__version__}".encode())
    return os.path.join(cache_dir, key.hexdigest()[:32] + ".json")


def _measure(config_text: str, selector: str, aot: bool) -> dict[str, Any]:
    """`floor` (or `compiled`) in `python -m jaxlearn.aot.fit`, with the target's number of
    fake CPU devices; its JSON stdout."""
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(selector_num_devices(selector)),
               JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S*", "",
                              env.get("XLA_FLAGS", "")).strip()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(config_text)
        f.flush()
        argv = [sys.executable, "-m", "jaxlearn.aot.fit", "--config", f.name,
                "--mesh_selector", selector, *(["--compile"] if aot else [])]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    try:
        return dict(json.loads(done.stdout))
    except ValueError:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"exit status {done.returncode}: {last[-300:]}") from None


def from_matrix(entry: Optional[dict[str, Any]]) -> Optional[Verdict]:
    """The verdict of a fresh AOT matrix entry (`matrix.lookup`); None for no entry or a
    recorded compile error."""
    if entry is None or "error" in entry:
        return None
    parts = (("params", int(entry["params_bytes"])),
             ("optimizer state", int(entry["optimizer_bytes"])),
             ("temporaries", int(entry["temp_bytes"])))
    usable = int(HBM_UTILIZATION * entry["hbm_bytes"])
    required = int(entry["required_bytes"])
    return Verdict("aot matrix", required <= usable, required, usable, int(entry["hbm_bytes"]),
                   parts)


def check_fit(config_text: str, selector: str, *, cache_dir: str, aot: bool = False,
              matrix_entry: Optional[dict[str, Any]] = None) -> Verdict:
    """The fresh AOT matrix entry's verdict when there is one, else the floor (or with `aot`
    the compiled figure) of the config `config_text` (flat text) on `selector`, cached in
    `cache_dir`."""
    recorded = from_matrix(matrix_entry)
    if recorded is not None:
        return recorded
    method = "aot" if aot else "floor"
    path = _cache_path(cache_dir, config_digest(config_text, selector), method)
    try:
        with open(path, encoding="utf-8") as f:
            figures = json.load(f)
    except (OSError, ValueError):
        try:
            figures = _measure(config_text, selector, aot)
        except (RuntimeError, KeyError, OSError) as e:
            return Verdict(method, None, error=str(e))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(figures, f)
        os.replace(path + ".tmp", path)
    usable = int(HBM_UTILIZATION * figures["hbm_bytes"])
    required = int(figures["required_bytes"])
    return Verdict(method, required <= usable, required, usable, int(figures["hbm_bytes"]),
                   tuple((str(k), int(v)) for k, v in figures["parts"]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m jaxlearn.aot.fit --config FILE --mesh_selector S [--compile]`: prints the
    floor's (or the compiled step's) figures of the flat-text config FILE as JSON (JAX must
    see the target's device count)."""
    p = argparse.ArgumentParser(prog="python -m jaxlearn.aot.fit")
    p.add_argument("--config", required=True, help="a final config in flat text form")
    p.add_argument("--mesh_selector", required=True)
    p.add_argument("--compile", action="store_true", help="the compiled step, not the floor")
    args = p.parse_args(argv)
    with open(args.config, encoding="utf-8") as f:
        cfg = from_flat_text(f.read(), where=args.config)
    measure = compiled if args.compile else floor
    print(json.dumps(measure(cfg, args.mesh_selector)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
