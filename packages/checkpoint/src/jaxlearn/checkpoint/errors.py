"""Exception types of jaxlearn.checkpoint. Every message names the step and the path."""

from __future__ import annotations

from typing import Sequence


class CheckpointError(Exception):
    """Base class of every error raised by jaxlearn.checkpoint."""


class CheckpointCorruptionError(CheckpointError):
    """A committed step whose bytes do not match what was recorded when it was saved.

    Raised for flipped bytes (digest mismatch), truncated or missing files, a missing or
    unreadable manifest, and for step directories that were never committed.
    `arrays` lists the array paths found bad (e.g. 'params.dense.w'); `files` the files.
    """

    def __init__(
        self,
        step: int,
        directory: str,
        problems: Sequence[str],
        *,
        arrays: Sequence[str] = (),
        files: Sequence[str] = (),
    ):
        self.step = step
        self.directory = directory
        self.problems = list(problems)
        self.arrays = sorted(set(arrays))
        self.files = sorted(set(files))
        lines = [f"Checkpoint step {step} at {directory} is corrupted:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class NoGoodCheckpointError(CheckpointCorruptionError):
    """Every committed step failed verification (see `failures`: step -> error)."""

    def __init__(self, directory: str, failures: dict[int, CheckpointCorruptionError]):
        self.failures = dict(failures)
        problems = [f"step {s}: {e.problems[0] if e.problems else e}" for s, e in failures.items()]
        super().__init__(
            max(failures) if failures else -1,
            directory,
            ["no committed step passed verification"] + problems,
        )


class CheckpointStructureError(CheckpointError, ValueError):
    """The restore target does not match what the step holds (a caller error, not damage)."""

    def __init__(
        self,
        step: int,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[str] = (),
    ):
        self.step = step
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = list(mismatched)
        lines = [f"Restore target does not match checkpoint step {step}:"]
        if self.missing:
            lines.append(
                "  in the checkpoint but not in the target (pass partial=True to skip): "
                + ", ".join(self.missing)
            )
        if self.unexpected:
            lines.append("  in the target but not in the checkpoint: " + ", ".join(self.unexpected))
        lines += [f"  {m}" for m in self.mismatched]
        super().__init__("\n".join(lines))


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The requested step has no directory under the checkpoint root."""


class CheckpointSaveError(CheckpointError):
    """A background save failed; raised by the next `save()` or `wait_until_finished()`."""
