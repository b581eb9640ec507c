"""The model a jaxlearn run serves: `open_run_model(path, experiment, overrides)`.

`interop.open_model` says what PATH holds. For a jaxlearn run the model config, tokenizer
and chat template are its run record's (`checkpoint.run_record.RunModel`, read from the
record's `model.` / `input.` lines alone); when that text no longer parses, the recorded
experiment + mesh selector + overrides are rebuilt (`build_config`) and checked against
the recorded `model.` lines; `--set` overrides of `model.*` / `input.tokenizer.*` go on
top. A checkpoint without a record needs an experiment: nothing is guessed. `serve`,
`generate` and `export` all open `--model` here. Problems raise `BuildError` (one line
naming PATH).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from jaxlearn.checkpoint.run_record import RunModel, RunRecordError, find_model_record
from jaxlearn.config import ConfigError, FlatTextError, apply_overrides, to_flat_text
from jaxlearn.experiments.build import BuildError, build_config
from jaxlearn.interop import InteropError, ModelSource, open_model

__all__ = ["model_difference", "open_run_model"]


# Fields that change how a step runs, not what the model computes (a CPU rule sets them
# by the host's memory: `remat_fit`).
_EXECUTION_ONLY = re.compile(r".*\.(remat_spec(\..*)?|unroll)$")


def _model_lines(flat_text: str) -> list[str]:
    return [line for line in flat_text.splitlines() if line.startswith("model.")
            and not _EXECUTION_ONLY.fullmatch(line.split(": ", 1)[0])]


def model_difference(recorded: str, rebuilt: str) -> Optional[str]:
    """None when both flat texts have the same `model.` lines (remat and unroll fields
    aside), else the first difference
    and how many lines differ, e.g. "model.decoder.dim: recorded 128, now 64; 1 line"."""
    def split(text: str) -> dict[str, str]:
        return dict(line.split(": ", 1) for line in _model_lines(text))

    a, b = split(recorded), split(rebuilt)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if not keys:
        return None
    k = keys[0]
    what = (f"recorded {a[k]}, now {b[k]}" if k in a and k in b
            else "only in the record" if k in a else "not in the record")
    return f"{k}: {what}; {len(keys)} line(s) differ"


def open_run_model(path: str, experiment: Optional[str] = None,
                   overrides: Sequence[str] = ()) -> tuple[ModelSource, Optional[str]]:
    """(the `ModelSource` of PATH, where a jaxlearn run's model config came from; None for
    HF / GGUF). See the module docstring."""
    p = Path(path)
    if not p.exists():
        raise BuildError(f"--model {path}: no such file or directory")
    try:
        source = open_model(p)
        if source.kind != "jaxlearn":
            return source, None
        record = find_model_record(p)
    except (InteropError, RunRecordError) as e:
        raise BuildError(" ".join(str(e).split())) from None
    if record is None:
        if experiment is None:
            raise BuildError(f"--model {path}: a jaxlearn checkpoint without a run record "
                             "(run.json); pass --experiment NAME (the experiment that "
                             "trained it)")
        cfg = build_config(experiment, None, overrides)
        return source.with_run(RunModel.from_config_text(to_flat_text(cfg), p)), \
            f"--experiment {experiment}"
    if record.experiment is not None and experiment not in (None, record.experiment):
        raise BuildError(f"--experiment {experiment}: the run record of {path} says the run "
                         f"is experiment {record.experiment!r}")
    described = (f"experiment {record.experiment or experiment!r}, mesh_selector "
                 f"{record.mesh_selector}, overrides {list(record.overrides)}")
    try:
        run = RunModel.from_config_text(record.config_text, p, base_model=record.base_model,
                                        where=f"{path} (run record config_text)")
        where = f"the run record's config text ({described})"
    except FlatTextError as e:
        text = to_flat_text(_rebuild_experiment(record, str(p), experiment, str(e)))
        run = RunModel.from_config_text(text, p, base_model=record.base_model)
        where = f"the run record: {described}"
    return source.with_run(_overridden(run, overrides)), where


def _overridden(run: Any, overrides: Sequence[str]) -> Any:
    """`run` with `--set` overrides of its `model.` and `input.tokenizer.` fields."""
    model, tok = run.model.clone(), run.tokenizer.clone() if run.tokenizer else None
    for o in overrides:
        target = (model, "model.") if o.startswith("model.") else (tok, "input.tokenizer.")
        if not o.startswith(target[1]) or target[0] is None:
            raise BuildError(f"--set {o}: a run's model.* and input.tokenizer.* fields are "
                             "what serving reads")
        try:
            apply_overrides(target[0], [o.removeprefix(target[1])])
        except ConfigError as e:
            raise BuildError(f"--set: {' '.join(str(e).split())}") from None
    return dataclasses.replace(run, model=model, tokenizer=tok)


def _rebuild_experiment(record: Any, where: str, experiment: Optional[str], why: str) -> Any:
    """The recorded experiment rebuilt by name (the recorded text did not parse: `why`),
    checked against the recorded `model.` lines."""
    name = record.experiment or experiment
    if name is None:
        raise BuildError(f"--model {where}: cannot rebuild the recorded config ({why}) and "
                         f"the record names no experiment; pass --experiment NAME")
    try:
        cfg = build_config(name, record.mesh_selector, record.overrides,
                           init_from=record.base_model)
    except BuildError as e:
        raise BuildError(f"--model {where}: cannot rebuild the recorded config ({why}) nor "
                         f"experiment {name!r}: {e}") from None
    diff = model_difference(record.config_text, to_flat_text(cfg))
    if diff is not None:
        raise BuildError(f"--model {where}: cannot rebuild the recorded config ({why}), and "
                         f"experiment {name!r} now builds a different model ({diff})")
    return cfg
