"""The commit record of a step: `manifest.json` (JSON only; nothing is ever unpickled).

It lists every array (kind, global shape, dtype, digest), every file of the step (size,
and sha256 for small files), and the user's metadata (`extra`, `metrics`). Its presence
inside a `step_<n>` directory is what makes the step committed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, cast

from jaxlearn.checkpoint import digest as digest_lib
from jaxlearn.checkpoint.errors import CheckpointCorruptionError
from jaxlearn.checkpoint.layout import MANIFEST, FileRecord
from jaxlearn.checkpoint.tree import LeafKind

FORMAT = "jaxlearn.checkpoint/1"


@dataclasses.dataclass(frozen=True)
class ArrayRecord:
    """One saved leaf: kind ('jax' | 'numpy' | 'scalar'), global shape, dtype, digest."""

    kind: LeafKind
    shape: tuple[int, ...]
    dtype: str
    digest: str


@dataclasses.dataclass
class Manifest:
    step: int
    arrays: dict[str, ArrayRecord]
    files: dict[str, FileRecord]
    extra: dict[str, Any]
    metrics: dict[str, float]
    process_count: int
    created_unix: float = dataclasses.field(default_factory=time.time)
    digest_algorithm: str = digest_lib.ALGORITHM

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT,
            "step": self.step,
            "created_unix": self.created_unix,
            "process_count": self.process_count,
            "digest_algorithm": self.digest_algorithm,
            "arrays": {
                k: {"kind": a.kind, "shape": list(a.shape), "dtype": a.dtype, "digest": a.digest}
                for k, a in self.arrays.items()
            },
            "files": {
                k: ({"size": f.size, "sha256": f.sha256} if f.sha256 else {"size": f.size})
                for k, f in self.files.items()
            },
            "extra": self.extra,
            "metrics": self.metrics,
        }
        return json.dumps(body, indent=1, sort_keys=True, allow_nan=True).encode()

    @classmethod
    def read(cls, step_path: Path, step: int) -> "Manifest":
        """Parses `<step_path>/manifest.json`; any problem is a CheckpointCorruptionError."""
        path = step_path / MANIFEST
        try:
            raw = json.loads(path.read_bytes())
            if raw.get("format") != FORMAT:
                raise ValueError(f"unknown format {raw.get('format')!r} (want {FORMAT!r})")
            if raw["digest_algorithm"] != digest_lib.ALGORITHM:
                raise ValueError(f"unknown digest algorithm {raw['digest_algorithm']!r}")
            if int(raw["step"]) != step:
                raise ValueError(f"manifest says step {raw['step']}, directory says {step}")
            arrays = {
                str(k): ArrayRecord(
                    kind=cast(LeafKind, _one_of(v["kind"], ("jax", "numpy", "scalar"))),
                    shape=tuple(int(d) for d in v["shape"]),
                    dtype=str(v["dtype"]),
                    digest=str(v["digest"]),
                )
                for k, v in dict(raw["arrays"]).items()
            }
            files = {
                str(k): FileRecord(int(v["size"]), v.get("sha256"))
                for k, v in dict(raw["files"]).items()
            }
            return cls(
                step=step,
                arrays=arrays,
                files=files,
                extra=dict(raw.get("extra") or {}),
                metrics={str(k): float(v) for k, v in dict(raw.get("metrics") or {}).items()},
                process_count=int(raw["process_count"]),
                created_unix=float(raw["created_unix"]),
                digest_algorithm=str(raw["digest_algorithm"]),
            )
        except FileNotFoundError:
            raise CheckpointCorruptionError(
                step, str(step_path), [f"{MANIFEST} is missing"], files=[MANIFEST]
            ) from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptionError(
                step, str(step_path), [f"{MANIFEST} is unreadable: {e}"], files=[MANIFEST]
            ) from e


def _one_of(value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {allowed}")
    return str(value)


def check_json_metadata(name: str, value: Any) -> dict[str, Any]:
    """`extra` must survive a JSON round trip unchanged; returns a copy."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict of JSON values, got {type(value).__name__}")
    try:
        text = json.dumps(value, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} is not JSON-serializable: {e}") from e
    return dict(json.loads(text))


def check_metrics(value: Any) -> dict[str, float]:
    if value is None:
        return {}
    out: dict[str, float] = {}
    for k, v in dict(value).items():
        try:
            f = float(v)
        except (TypeError, ValueError) as e:
            raise TypeError(f"metric {k!r} must be a number, got {v!r}") from e
        out[str(k)] = f if math.isfinite(f) else float("nan")
    return out
