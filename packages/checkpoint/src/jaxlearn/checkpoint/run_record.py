"""The record of what built a run: experiment name, mesh selector, overrides and the full
flat config text, written as `run.json` in the output directory and in every checkpoint.

    record = RunRecord(experiment="tiny-llama", mesh_selector=None,
                       overrides=["max_step=300"], config_text=to_flat_text(cfg))
    record.write(output_dir)                    # <output_dir>/run.json
    record = find_run_record("runs/tiny-llama")  # a run dir, its checkpoints dir or a step dir

    run = read_run_model("runs/tiny-llama")      # RunModel: model config, tokenizer, template

The model-facing part of a record (`RunModel`: the model config, the tokenizer config
with its path pointing at the run directory's own copy, the chat template and its BOS/EOS
texts) is read from the `model.` and `input.` lines of `config_text` alone, so a reader of
a run's model needs neither the trainer nor its config's shape; a run directory keeps its
tokenizer under `<run>/tokenizer/` (`save_tokenizer`), so it stays self-contained when
moved. Readers never guess which recipe a checkpoint came from. The file is JSON: nothing
is unpickled, and every field is type-checked on read, with errors naming the file and
the field.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Union

from jaxlearn.checkpoint import storage

RECORD_FILE = "run.json"
TOKENIZER_DIR = "tokenizer"  # <output_dir>/tokenizer/: the run's own copy of its tokenizer
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "chat_template.jinja",
                        "special_tokens_map.json")
FORMAT_VERSION = 1


class RunRecordError(ValueError):
    """A run record that is missing, unreadable or malformed (the message names the file)."""


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What built a run. `overrides` are `path=value` strings applied in order after the
    experiment's mesh rule (CLI flags such as `--max_step` are recorded as overrides);
    `base_model` names the pretrained model a fine-tuning run started from, if any."""

    experiment: Optional[str]
    mesh_selector: Optional[str]
    overrides: tuple[str, ...]
    config_text: str
    base_model: Optional[str] = None

    def to_json(self) -> str:
        body = {"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}
        body["overrides"] = list(self.overrides)
        return json.dumps(body, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "run record") -> "RunRecord":
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise RunRecordError(f"{where}: not JSON ({e})") from None
        if not isinstance(body, dict):
            raise RunRecordError(f"{where}: expected a JSON object, got {type(body).__name__}")
        version = body.get("format_version")
        if version != FORMAT_VERSION:
            raise RunRecordError(f"{where}: format_version {version!r} is not {FORMAT_VERSION}")

        def field(name: str, kind: type, optional: bool) -> Any:
            value = body.get(name)
            if value is None and optional:
                return None
            if not isinstance(value, kind):
                raise RunRecordError(f"{where}: field {name!r} must be {kind.__name__}"
                                     f"{' or null' if optional else ''}, got {value!r:.80}")
            return value

        overrides = field("overrides", list, False)
        if not all(isinstance(o, str) for o in overrides):
            raise RunRecordError(f"{where}: field 'overrides' must be a list of strings")
        return cls(experiment=field("experiment", str, True),
                   mesh_selector=field("mesh_selector", str, True),
                   overrides=tuple(overrides),
                   config_text=field("config_text", str, False),
                   base_model=field("base_model", str, True))

    def write(self, directory: Union[str, os.PathLike[str]]) -> storage.StoragePath:
        """Writes `<directory>/run.json` atomically (temp file + rename; on an object store
        one PUT); returns its path. A local directory also gets a copy of the run's
        tokenizer file (`save_tokenizer`), so the run directory is self-contained."""
        if storage.is_remote(directory):
            remote = storage.resolve(directory, check=False) / RECORD_FILE
            remote.write_text(self.to_json())
            return remote
        path = Path(directory) / RECORD_FILE
        save_tokenizer(directory, self.config_text)
        tmp = path.with_name(f".{RECORD_FILE}.tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: Union[str, os.PathLike[str]]) -> "RunRecord":
        """Reads a `run.json` file."""
        try:
            text = _path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise RunRecordError(f"{path}: cannot read the run record ({e})") from None
        return cls.from_json(text, where=str(path))


def find_run_record(path: Union[str, os.PathLike[str]]) -> Optional[RunRecord]:
    """The record of the run at `path`: a run's output directory, its `checkpoints/`
    directory, or one checkpoint step directory (whose own copy wins). None when there is
    no `run.json` in any of those places; a malformed one raises RunRecordError."""
    p = _path(path)
    candidates = [p / RECORD_FILE]
    if p.name == "checkpoints":
        candidates.append(p.parent / RECORD_FILE)
    elif p.parent.name == "checkpoints":
        candidates.append(p.parent.parent / RECORD_FILE)
    for candidate in candidates:
        if candidate.is_file():
            return RunRecord.read(candidate)
    return None


def find_model_record(path: Union[str, os.PathLike[str]]) -> Optional[RunRecord]:
    """`find_run_record(path)`, else the record of the newest step directory under the
    checkpoint root at `path` that holds one (a run dir whose top-level `run.json` is
    gone); None when there is none."""
    record = find_run_record(path)
    if record is not None or storage.is_remote(path):
        return record
    from jaxlearn.checkpoint.errors import CheckpointNotFoundError
    from jaxlearn.checkpoint.locate import locate

    try:
        root, _ = locate(Path(path))
    except CheckpointNotFoundError:
        return None
    steps = sorted((p for p in root.glob("step_*")
                    if p.name[5:].isdigit() and (p / RECORD_FILE).is_file()),
                   key=lambda p: int(p.name[5:]))
    return RunRecord.read(steps[-1] / RECORD_FILE) if steps else None


@dataclasses.dataclass(frozen=True)
class RunModel:
    """The model-facing part of a run's config: `model` (the model config), `tokenizer`
    (the `input.tokenizer` config, its file the run directory's own copy when it has one;
    None when the run's input has no tokenizer), `chat_template` (the `input.chat_template`
    source its data was rendered with; None: the input has no such field) with its
    `bos_token` / `eos_token` texts, and `base_model` (the pretrained model the run
    started from)."""

    model: Any
    tokenizer: Any = None
    chat_template: Optional[str] = None
    bos_token: str = ""
    eos_token: str = ""
    base_model: Optional[str] = None

    @classmethod
    def from_config_text(cls, text: str, run_dir: Union[str, os.PathLike[str], None] = None,
                         *, where: str = "config text",
                         base_model: Optional[str] = None) -> "RunModel":
        """From a flat config text (a record's `config_text`, or `to_flat_text` of a
        trainer config): only its `model.` and `input.` lines are read. `run_dir`: the run
        whose tokenizer copy replaces the recorded tokenizer path. Raises
        `jaxlearn.config.FlatTextError` when those lines no longer parse."""
        from jaxlearn.config import from_flat_text

        model_text = _subtree(text, "model.")
        if "klass: " not in model_text:
            raise RunRecordError(f"{where}: no model config (no 'model.klass' line)")
        model = from_flat_text(model_text, where=f"{where} (model.)")
        tok_text = _subtree(text, "input.tokenizer.")
        tokenizer = None
        if "klass: " in tok_text:
            tokenizer = from_flat_text(tok_text, where=f"{where} (input.tokenizer.)")
            path = getattr(tokenizer, "path", None)
            if run_dir is not None and isinstance(path, str):
                tokenizer.path = run_tokenizer_path(run_dir, path)
        chat = _value(text, "input.chat_template")
        return cls(model=model, tokenizer=tokenizer,
                   chat_template=chat if isinstance(chat, str) else None,
                   bos_token=_value(text, "input.bos_token") or "",
                   eos_token=_value(text, "input.eos_token") or "", base_model=base_model)


def read_run_model(path: Union[str, os.PathLike[str]]) -> Optional[RunModel]:
    """The `RunModel` of the run at `path` (a run dir, its `checkpoints/` or a step dir)
    from its record (`find_model_record`); None when it has none."""
    record = find_model_record(path)
    if record is None:
        return None
    return RunModel.from_config_text(record.config_text, path, where=f"{path} (run record)",
                                     base_model=record.base_model)


def _subtree(text: str, prefix: str) -> str:
    """The lines of flat `text` under `prefix`, with the prefix cut off."""
    return "".join(line[len(prefix):] + "\n" for line in text.splitlines()
                   if line.startswith(prefix))


def _value(text: str, path: str) -> Any:
    """The Python literal on flat `text`'s `path: ` line (None: no such line)."""
    for line in text.splitlines():
        if line.startswith(f"{path}: "):
            try:
                return ast.literal_eval(line.split(": ", 1)[1])
            except (ValueError, SyntaxError):
                return None
    return None


def _run_dirs(p: Any) -> list[Any]:
    """The directories that may be a run's output dir for a run dir, its `checkpoints/`
    directory or one step directory."""
    if p.name == "checkpoints":
        return [p, p.parent]
    if p.parent.name == "checkpoints":
        return [p, p.parent.parent]
    return [p]


def _tokenizer_path(config_text: str) -> Optional[str]:
    """`input.tokenizer.path` of a flat config text (None: no such field, or empty)."""
    value = _value(config_text, "input.tokenizer.path")
    return value if isinstance(value, str) and value else None


def save_tokenizer(directory: Union[str, os.PathLike[str]], config_text: str) -> Optional[Path]:
    """Copies the tokenizer file the run's config names (`input.tokenizer.path`) and the HF
    files beside it (TOKENIZER_SIDE_FILES) into `<directory>/tokenizer/` (once; a resumed
    run keeps its copy), so that moving or copying the run directory keeps its tokenizer.
    Returns the copy; None when the config names no file or `directory` is remote."""
    source = _tokenizer_path(config_text)
    if source is None or storage.is_remote(directory) or not os.path.isfile(source):
        return None
    target = Path(directory) / TOKENIZER_DIR
    copy = target / os.path.basename(source)
    if copy.is_file():
        return copy
    target.mkdir(parents=True, exist_ok=True)
    siblings = [os.path.join(os.path.dirname(source), n) for n in TOKENIZER_SIDE_FILES]
    if source.lower().endswith(".gguf"):  # A whole model file: linked when it can be.
        siblings = []
        try:
            os.link(source, copy)
            return copy
        except OSError:
            pass
    for name in [source, *[s for s in siblings if os.path.isfile(s) and s != source]]:
        tmp = target / f".{os.path.basename(name)}.tmp"
        shutil.copyfile(name, tmp)
        os.replace(tmp, target / os.path.basename(name))
    return copy


def run_tokenizer_path(path: Union[str, os.PathLike[str]], source: str) -> str:
    """The tokenizer file of the run at `path` (a run dir, its `checkpoints/` or a step
    dir) whose config names `source` (`input.tokenizer.path`): the run directory's own
    copy (`save_tokenizer`) when it has one, else `source`."""
    if not source or storage.is_remote(path):
        return source
    for run_dir in _run_dirs(Path(path)):
        copy = run_dir / TOKENIZER_DIR / os.path.basename(source)
        if copy.is_file():
            return str(copy)
    return source


def _path(path: Union[str, os.PathLike[str]]) -> storage.StoragePath:
    """A local `Path`, or an object store's `epath.Path` (backend checked)."""
    return storage.resolve(path) if storage.is_remote(path) else Path(path)
