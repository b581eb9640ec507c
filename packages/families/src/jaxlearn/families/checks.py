"""Checks of untrusted hyperparameters (HF config.json, GGUF metadata) made before a
config is built or anything is allocated. Every failure is a one-line
`MalformedFileError` naming the file and the field.

    dim = integer(hf.get("hidden_size"), where, "hidden_size", high=LIMITS["dim"])
    check_heads(where, dim=dim, heads=heads, kv_heads=kv, head_dim=None, fields=(...))
    check_layers_present(arch, "hf", reader.names(), where=..., field="num_hidden_layers",
                         source=str(directory))

`LIMITS` are far above every published model (vocabularies up to 2**24 tokens, widths up
to 2**17) and far below sizes that exhaust memory when a config is instantiated.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional

from jaxlearn.families.arch import Architecture
from jaxlearn.families.errors import MalformedFileError
from jaxlearn.families.names import Row, features

LIMITS = {
    "vocab_size": 2**24,
    "dim": 2**17,
    "num_layers": 2**20,
    "num_heads": 2**14,
    "head_dim": 2**14,
    "ffn_dim": 2**20,
    "num_experts": 2**12,
    "window": 2**40,
    "positions": 2**40,
}
SHOWN = 3  # missing tensors named in a message before "... and N more"


def integer(value: Any, where: str, field: str, *, low: int = 1, high: int) -> int:
    """`value` as an int in [low, high] (integral floats accepted; bools, strings, NaN
    and fractions refused)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedFileError(f"{where}: {field} = {value!r} is not an integer")
    if not low <= value <= high:
        raise MalformedFileError(f"{where}: {field} = {value} is out of range [{low}, {high}]")
    return value


def optional_integer(
    value: Any, where: str, field: str, *, low: int = 1, high: int
) -> Optional[int]:
    return None if value is None else integer(value, where, field, low=low, high=high)


def flag(value: Any, where: str, field: str, default: bool = False) -> bool:
    """`value` as a bool (`default` when None); "false" and 0 are refused, not truthy."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise MalformedFileError(f"{where}: {field} = {value!r} is not true or false")
    return value


def number(value: Any, where: str, field: str, *, positive: bool = True) -> float:
    """`value` as a finite float (> 0 when `positive`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedFileError(f"{where}: {field} = {value!r} is not a number")
    out = float(value)
    if not math.isfinite(out) or (positive and out <= 0):
        raise MalformedFileError(f"{where}: {field} = {value!r} must be a finite number > 0")
    return out


def check_heads(
    where: str,
    *,
    dim: int,
    heads: int,
    kv_heads: int,
    head_dim: Optional[int],
    fields: tuple[str, str, str],
) -> int:
    """The head dim: `head_dim` when the file gives one, else dim // heads, which must
    divide exactly. kv_heads must divide heads. fields: the file's names for (dim, heads,
    kv heads)."""
    dim_f, heads_f, kv_f = fields
    if heads % kv_heads:
        raise MalformedFileError(
            f"{where}: {kv_f} = {kv_heads} does not divide {heads_f} = {heads}"
        )
    if head_dim is not None:
        return head_dim
    if dim % heads:
        raise MalformedFileError(
            f"{where}: {heads_f} = {heads} does not divide {dim_f} = {dim} (and no head "
            f"dimension is given)"
        )
    return dim // heads


def _pattern(template: str) -> re.Pattern[str]:
    """A regex of a name template whose group 1 is the layer index `{i}`."""
    parts = re.split(r"(\{i\}|\{j\})", template)
    body = "".join(
        r"(\d+)" if p == "{i}" else r"\d+" if p == "{j}" else re.escape(p) for p in parts
    )
    return re.compile(body)


def _layers_holding(row: Row, fmt: str, names: set[str]) -> set[int]:
    """The layer indices at which `names` hold (one of the names of) `row`."""
    out: set[int] = set()
    for name in row.names(fmt):
        pattern = _pattern(name.template)
        for n in names:
            m = pattern.fullmatch(n)
            if m:
                out.add(int(m.group(1)))
    return out


def check_layers_present(
    arch: Architecture, fmt: str, names: Iterable[str], *, where: str, field: str, source: str
) -> None:
    """Raises MalformedFileError when some of the `arch.num_layers` layers that the file's
    `field` declares have no tensors at all in `names` (the tensors of the file); the
    message names the first few missing tensors and how many more there are. (Layers that
    are present but incomplete are listed by `convert.check_source`.)

    Costs O(len(names) * rows), whatever `arch.num_layers` says.
    """
    from jaxlearn.families.registry import family  # (the families import this module)

    available = set(names)
    on = features(arch)
    rows = [r for r in family(arch).rows if r.per_layer and (not r.when or r.when in on)]
    present: set[int] = set()
    for row in rows:
        present |= {i for i in _layers_holding(row, fmt, available) if i < arch.num_layers}
    absent = arch.num_layers - len(present)
    if not absent:
        return
    shown: list[str] = []
    i = 0
    while rows and len(shown) < SHOWN:  # at most len(present) + SHOWN steps
        if i not in present:
            shown += [r.names(fmt)[0].template.format(i=i, j=0) for r in rows]
        i += 1
    count = absent * len(rows)
    shown = shown[:SHOWN]
    more = f" ... and {count - len(shown)} more" if count > len(shown) else ""
    raise MalformedFileError(
        f"{where}: {field} = {arch.num_layers}, but {absent} of those layers have no tensors "
        f"in {source} ({count} tensors missing: {', '.join(shown)}{more})"
    )
