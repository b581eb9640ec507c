"""The one builder of a run's config: what `jaxlearn config` prints is what `train` runs.

    run = build_run("tiny-llama", "cpu-8", ["learner.learning_rate=1e-3"],
                    RunFlags(output_dir="runs/x", max_step=10, data=("corpus.txt",)))
    run.config            # the final Trainer.Config
    run.record()          # its RunRecord (experiment, selector, overrides, flat text)
    cfg = build_config("tiny-llama", "cpu-8", overrides)   # no run flags

The order is fixed: recipe -> `--init_from` model (`init_from.apply_init_from`) -> mesh rule
for the selector -> `--set` overrides (text, as the user typed them) -> the run flags
(`RUN_FLAGS`: each flag sets typed values on config fields, no text round trip) ->
validation (`Config.validate`) -> elastic adaptation (`--elastic` with an output dir that
holds a reference: `learner.num_microbatches` for this machine's devices) -> the input
pipeline built and asked for its first batch iterator (bad data fails here). Every problem
is a `BuildError` whose message is one line naming the flag or config path.

The run record holds the flags as `path=value` texts (rendered from the typed values, never
parsed back here), so `build_config(record.experiment, record.mesh_selector,
record.overrides)` rebuilds the recorded config.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence

from jaxlearn.checkpoint import storage
from jaxlearn.config import ConfigBase, ConfigError, apply_overrides, to_flat_text
from jaxlearn.experiments.init_from import InitFromUsageError, apply_init_from
from jaxlearn.experiments.recipes import get_experiment
from jaxlearn.mesh import (
    HARDWARE,
    MeshError,
    UnknownHardwareError,
    apply_mesh_rules,
    current_selector,
    parse_selector,
)
from jaxlearn.resilience.elastic import ElasticDecision, adapt_to_devices
from jaxlearn.runtime.data import TextFilesSource
from jaxlearn.runtime.record import RunRecord
from jaxlearn.runtime.sft import SFTSource


class BuildError(ValueError):
    """A problem with what the user asked for (one line naming the flag or config path)."""


def one_line(e: BaseException) -> str:
    """An error's message on one line."""
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())


@dataclasses.dataclass(frozen=True)
class RunFlags:
    """The typed run flags of `jaxlearn train` / `config` (None / empty: not given)."""

    output_dir: Optional[str] = None
    max_step: Optional[int] = None
    data: tuple[str, ...] = ()
    profile_steps: Optional[str] = None
    elastic: bool = False
    init_from: Optional[str] = None
    init_adapter: Optional[str] = None
    reward: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Setting:
    """One typed value a run flag sets, and its `path=value` text for the run record."""

    path: str
    value: Any
    text: str


def _setting(path: str, value: Any) -> Setting:
    if isinstance(value, ConfigBase):  # A class's default config: named by the class.
        klass = value.klass
        return Setting(path, value, f"{path}={klass.__module__}.{klass.__qualname__}")
    return Setting(path, value, f"{path}={value!r}")


def normalize_output_dir(path: str) -> str:
    """A local path with `..` becomes the real path it names (`x/../run` is `run`), so making
    it never creates `x` on the way; other paths stay as given."""
    if not storage.is_remote(path) and ".." in path.split(os.sep):
        return os.path.realpath(path)
    return path


def _is_sft_source(source: Any) -> bool:
    klass = getattr(source, "klass", None)
    return isinstance(klass, type) and issubclass(klass, SFTSource)


def _data(cfg: Any, paths: tuple[str, ...]) -> list[Setting]:
    out = []
    for name in ("input", "eval_input"):
        inp = getattr(cfg, name, None)
        if inp is None:
            continue
        if not _is_sft_source(inp.source):  # SFT rows stay SFT rows: only the paths change.
            out.append(_setting(f"{name}.source", TextFilesSource.default_config()))
        out.append(_setting(f"{name}.source.paths", list(paths)))
    return out


def _reward(cfg: Any, specs: tuple[str, ...]) -> list[Setting]:
    if getattr(cfg, "rollout", None) is None:
        raise BuildError("--reward: this experiment samples nothing to reward (no rollout); "
                         "use an RL recipe such as grpo or grpo-lora")
    # A reward file is named by its absolute path: the run record rebuilds the run anywhere.
    def absolute(spec: str) -> str:
        target, sep, name = spec.rpartition(":")
        if sep and target.endswith(".py") and not storage.is_remote(target):
            return f"{os.path.abspath(target)}:{name}"
        return spec

    return [_setting("rollout.rewards", [absolute(s) for s in specs])]


def _profile_steps(cfg: Any, text: str) -> list[Setting]:
    try:
        steps = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise BuildError(f"--profile_steps {text!r}: expected comma-separated step numbers, "
                         "e.g. 5,6,7") from None
    return [_setting("profile_steps", steps)]


@dataclasses.dataclass(frozen=True)
class RunFlag:
    """One row of `RUN_FLAGS`: the config fields a flag sets and how.

    `settings(cfg, value)` gives the typed values to set after `--set` (`cfg`: the config so
    far, e.g. for which inputs exist); None for `init_from`, which rebuilds the recipe's
    model and inputs before the mesh rules (`init_from.apply_init_from`)."""

    fields: str
    settings: Optional[Callable[[Any, Any], list[Setting]]]


RUN_FLAGS: dict[str, RunFlag] = {
    "init_from": RunFlag("model, input.tokenizer, input.chat_template, init_from", None),
    "init_adapter": RunFlag("model, init_from", None),
    "output_dir": RunFlag("output_dir", lambda cfg, v: [
        _setting("output_dir", normalize_output_dir(v))]),
    "max_step": RunFlag("max_step", lambda cfg, v: [_setting("max_step", v)]),
    "data": RunFlag("input.source, eval_input.source", _data),
    "profile_steps": RunFlag("profile_steps", _profile_steps),
    "elastic": RunFlag("resilience.elastic", lambda cfg, v: [
        _setting("resilience.elastic", True)]),
    "reward": RunFlag("rollout.rewards", _reward),
}


def _given(value: Any) -> bool:
    return value is not None and value is not False and value != ()


def resolve_selector(selector: Optional[str]) -> str:
    """`selector` checked against the hardware catalogue, or this machine's selector."""
    if selector is None:
        return current_selector()
    try:
        parse_selector(selector)
    except UnknownHardwareError as e:
        raise BuildError(f"--mesh_selector {selector!r} is not a known mesh selector "
                         f"({str(e).split(';')[0]}); known kinds: {', '.join(sorted(HARDWARE))}, "
                         "written KIND-COUNT such as cpu-8 or tpu-v5p-256") from None
    return selector


def build_config(experiment: str, selector: Optional[str], overrides: Sequence[str] = (), *,
                 init_from: Optional[str] = None, init_adapter: Optional[str] = None,
                 validate: bool = True) -> Any:
    """Recipe -> `init_from` model (and `init_adapter` LoRA adapter) -> mesh rule for
    `selector` (None: this machine's) -> `path=value` overrides -> validation (field
    limits, `Config.validate`)."""
    try:
        cfg: Any = get_experiment(experiment)
    except KeyError as e:
        raise BuildError(str(e.args[0])) from None
    try:
        cfg = apply_init_from(cfg, init_from, init_adapter)
    except InitFromUsageError as e:
        raise BuildError(one_line(e)) from None
    try:
        cfg, _ = apply_mesh_rules(cfg, resolve_selector(selector))
        apply_overrides(cfg, overrides)
        if validate:
            cfg.validate()
    except (ConfigError, MeshError) as e:
        raise BuildError(one_line(e)) from None
    return cfg


@dataclasses.dataclass
class BuiltRun:
    """A run's final config and what its run record holds.

    Attributes:
        experiment, selector: the recipe and the resolved mesh selector.
        config: the final `Trainer.Config` (what `jaxlearn config` prints).
        overrides: `--set` overrides, then each run flag's `path=value` texts, then an
            elastic `learner.num_microbatches`, in the order they were applied.
        base_model: `--init_from`'s path.
        elastic: the elastic decision (its `record()` writes the reference once training
            starts), or None without `--elastic` or an output dir.
    """

    experiment: str
    selector: str
    config: Any
    overrides: tuple[str, ...]
    base_model: Optional[str] = None
    elastic: Optional[ElasticDecision] = None

    def record(self) -> RunRecord:
        return RunRecord(self.experiment, self.selector, self.overrides,
                         to_flat_text(self.config), base_model=self.base_model)


def _apply_flags(cfg: Any, flags: RunFlags) -> list[str]:
    """Sets every given run flag's fields on `cfg` (`RUN_FLAGS`); their record texts."""
    texts = []
    for name, row in RUN_FLAGS.items():
        value = getattr(flags, name)
        if row.settings is None or not _given(value):
            continue
        for s in row.settings(cfg, value):
            try:
                cfg.set_recursively(s.path, s.value)
            except ConfigError as e:
                raise BuildError(f"--{name}: {s.path}: {one_line(e)}") from None
            texts.append(s.text)
    return texts


def _adapt(cfg: Any, texts: list[str]) -> Optional[ElasticDecision]:
    """`--elastic`: this machine's `learner.num_microbatches` against the run's reference
    (recorded as an override when it changes, so the record rebuilds it)."""
    if not cfg.resilience.elastic or not cfg.output_dir:
        return None
    micro = cfg.learner.num_microbatches
    try:
        decision = adapt_to_devices(cfg)
    except ConfigError as e:  # ElasticError
        raise BuildError(f"--elastic: {one_line(e)}") from None
    if cfg.learner.num_microbatches != micro:
        texts.append(f"learner.num_microbatches={cfg.learner.num_microbatches}")
    return decision


def check_inputs(cfg: Any, flags: RunFlags) -> None:
    """Builds the input pipeline and its first iterator: bad data fails here, before
    anything is written."""
    try:
        cfg.input.instantiate().iterator(0, 1)
    except (ConfigError, ValueError, OSError) as e:
        raise BuildError(f"{'--data' if flags.data else 'input'}: {one_line(e)}") from None
    if getattr(cfg, "rollout", None) is not None:
        try:  # Loads the reward functions.
            cfg.rollout.instantiate()
        except (ConfigError, ValueError) as e:
            raise BuildError(f"{'--reward' if flags.reward else 'rollout'}: "
                             f"{one_line(e)}") from None


def build_run(experiment: str, selector: Optional[str], overrides: Sequence[str],
              flags: RunFlags = RunFlags(), *, inputs: bool = True) -> BuiltRun:
    """The final config of `jaxlearn train` / `config` with these flags (see the module
    doc); `inputs=False` skips building the input pipeline."""
    selector = resolve_selector(selector)
    cfg = build_config(experiment, selector, overrides, init_from=flags.init_from,
                       init_adapter=flags.init_adapter, validate=False)
    texts = _apply_flags(cfg, flags)
    try:
        cfg.validate()
    except ConfigError as e:
        raise BuildError(one_line(e)) from None
    elastic = _adapt(cfg, texts)
    if inputs:
        check_inputs(cfg, flags)
    return BuiltRun(experiment, selector, cfg, (*overrides, *texts), flags.init_from, elastic)


__all__ = ["RUN_FLAGS", "BuildError", "BuiltRun", "RunFlag", "RunFlags", "Setting",
           "build_config", "build_run", "check_inputs", "normalize_output_dir", "one_line",
           "resolve_selector"]
