"""Silent data corruption (SDC) checks: results that must be bitwise equal, compared.

Two checks, on a step policy (`every_n_steps`):

* replicas: every array replicated over a mesh axis (params and optimizer state over
  `data`, the step, the PRNG key) holds bitwise-identical shards on each of its devices.
  Shards are grouped by the slice of the global array they hold and compared by a hash of
  their bytes; the devices that disagree with the majority of their group are named.
* recompute: the step is run twice on the same state and batch (the second time on a copy)
  and the two results are compared shard by shard on each device: a device that computes
  differently from itself is named.

On a mismatch, `on_mismatch` decides: `stop` raises SdcError (exit status 43: the
supervisor restarts from the newest checkpoint, which the `check_before_save` replica check
guarantees was taken from agreeing replicas), `skip` repairs replicas from their majority
(or, for a recompute mismatch, drops the step's update: params and optimizer state stay as
before the step), `log` only logs.

Cost: one device->host copy of every local shard of the state per check (and, for
recompute, one more step and one or two copies of the state on device). Replicas are
compared within each process; a process whose every replica diverged the same way is not
caught by this check (the checkpoint digests compare across processes at save time).

`flip_bit` is the fault-injection hook: it flips one bit of one device's shard, so the
checks can be tested on CPU.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
from typing import Any, Callable, Literal, Optional, Sequence

import jax
import numpy as np

from jaxlearn.config import ConfigError, Configurable
from jaxlearn.resilience.failures import SdcError

log = logging.getLogger("jaxlearn.sdc")


def device_name(device: Any) -> str:
    """E.g. 'cpu:3 (process 0)'."""
    return f"{device.platform}:{device.id} (process {device.process_index})"


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One array slice whose copies disagree."""

    path: str
    index: tuple  # The slice of the global array, as ((start, stop), ...).
    bad_devices: tuple[Any, ...]
    good_devices: tuple[Any, ...]

    def describe(self) -> str:
        bad = ", ".join(device_name(d) for d in self.bad_devices)
        if not self.good_devices:
            return f"{self.path}{list(self.index)}: no majority among devices {bad}"
        good = ", ".join(str(d.id) for d in self.good_devices)
        return f"{self.path}{list(self.index)}: device(s) {bad} disagree with devices [{good}]"


@dataclasses.dataclass
class SdcReport:
    step: int
    kind: str  # "replicas" | "recompute"
    mismatches: list[Mismatch]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    @property
    def bad_devices(self) -> list[Any]:
        seen: dict[int, Any] = {}
        for m in self.mismatches:
            for d in m.bad_devices:
                seen.setdefault(d.id, d)
        return [seen[k] for k in sorted(seen)]

    def describe(self) -> str:
        if self.ok:
            return f"SDC {self.kind} check at step {self.step}: ok"
        names = ", ".join(device_name(d) for d in self.bad_devices)
        lines = [f"SDC {self.kind} check at step {self.step}: {len(self.mismatches)} "
                 f"mismatch(es); suspect device(s): {names}"]
        lines += [f"  {m.describe()}" for m in self.mismatches[:20]]
        if len(self.mismatches) > 20:
            lines.append(f"  ... and {len(self.mismatches) - 20} more")
        return "\n".join(lines)


# ---- comparing shards -----------------------------------------------------------------------


def _leaves(tree: Any) -> list[tuple[str, jax.Array]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for keypath, leaf in flat:
        if isinstance(leaf, jax.Array):
            out.append(("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath),
                        leaf))
    return out


def _index_key(index: tuple, shape: tuple[int, ...]) -> tuple:
    return tuple(
        (s.start or 0, dim if s.stop is None else s.stop) if isinstance(s, slice) else (s, s + 1)
        for s, dim in zip(index, shape)
    )


def _shard_hash(data: jax.Array) -> bytes:
    if jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(data)
    host = np.ascontiguousarray(np.asarray(data))
    return hashlib.blake2b(host.tobytes(), digest_size=16).digest()


def compare_replicas(tree: Any) -> list[Mismatch]:
    """Mismatches among the local replicas of every array leaf of `tree`."""
    out = []
    for path, leaf in _leaves(tree):
        groups: dict[tuple, list[tuple[Any, bytes]]] = collections.defaultdict(list)
        for shard in leaf.addressable_shards:
            groups[_index_key(shard.index, leaf.shape)].append(
                (shard.device, _shard_hash(shard.data)))
        for index, members in groups.items():
            if len(members) < 2 or len({h for _, h in members}) == 1:
                continue
            counts = collections.Counter(h for _, h in members)
            top, n = counts.most_common(1)[0]
            if n * 2 > len(members):
                bad = tuple(d for d, h in members if h != top)
                good = tuple(d for d, h in members if h == top)
            else:
                bad, good = tuple(d for d, _ in members), ()
            out.append(Mismatch(path, index, bad, good))
    return out


def compare_trees(a: Any, b: Any) -> list[Mismatch]:
    """Mismatches between two trees of the same structure and shardings, device by device."""
    out = []
    leaves_b = dict(_leaves(b))
    for path, x in _leaves(a):
        y = leaves_b[path]
        ys = {s.device.id: s for s in y.addressable_shards}
        for sx in x.addressable_shards:
            sy = ys[sx.device.id]
            if _shard_hash(sx.data) != _shard_hash(sy.data):
                out.append(Mismatch(path, _index_key(sx.index, x.shape), (sx.device,), ()))
    return out


def repair_replicas(tree: Any, mismatches: Sequence[Mismatch]) -> Any:
    """`tree` with each bad replica replaced by a copy of a majority replica.
    Raises SdcError if some slice has no majority."""
    by_path: dict[str, list[Mismatch]] = collections.defaultdict(list)
    for m in mismatches:
        if not m.good_devices:
            raise SdcError(f"cannot repair {m.describe()}")
        by_path[m.path].append(m)

    def fix(path: str, leaf: jax.Array) -> jax.Array:
        if path not in by_path:
            return leaf
        shards = {s.device.id: s for s in leaf.addressable_shards}
        replace = {}
        for m in by_path[path]:
            source = shards[m.good_devices[0].id].data
            for d in m.bad_devices:
                replace[d.id] = jax.device_put(source, d)
        arrays = [replace.get(s.device.id, s.data) for s in leaf.addressable_shards]
        return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays)

    return _map_with_path(fix, tree)


def _map_with_path(fn: Callable[[str, jax.Array], jax.Array], tree: Any) -> Any:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for keypath, leaf in flat:
        path = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)
        out.append(fn(path, leaf) if isinstance(leaf, jax.Array) else leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


# ---- fault injection ------------------------------------------------------------------------


def flip_bit(x: jax.Array, device_id: int, *, flat_index: int = 0, bit: int = 0) -> jax.Array:
    """A copy of `x` whose shard on device `device_id` has bit `bit` of element
    `flat_index` (of that shard) flipped; every other shard is shared with `x`."""
    arrays = []
    found = False
    for shard in x.addressable_shards:
        if shard.device.id == device_id:
            host = np.array(shard.data)  # A private copy.
            raw = host.reshape(-1).view(np.uint8)
            byte = flat_index * host.dtype.itemsize + bit // 8
            if byte >= raw.size:
                raise ValueError(f"flip_bit: element {flat_index} bit {bit} is outside the "
                                 f"shard of shape {host.shape}")
            raw[byte] ^= np.uint8(1 << (bit % 8))
            arrays.append(jax.device_put(host, shard.device))
            found = True
        else:
            arrays.append(shard.data)
    if not found:
        raise ValueError(f"flip_bit: device {device_id} holds no local shard of this array")
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)


def flip_bit_in_tree(tree: Any, path: str, device_id: int, **kw: Any) -> Any:
    """`tree` with `flip_bit` applied to the leaf at `path` ('params/table')."""
    paths = [p for p, _ in _leaves(tree)]
    if path not in paths:
        raise KeyError(f"flip_bit_in_tree: no array leaf {path!r} (have {paths[:10]}...)")
    return _map_with_path(lambda p, x: flip_bit(x, device_id, **kw) if p == path else x, tree)


# ---- the checker ----------------------------------------------------------------------------


class SdcChecker(Configurable):
    """The SDC check policy; the trainer's guard calls it at due steps."""

    class Config(Configurable.Config):
        # Check after every N-th step; 0: never (except before saves, see below).
        every_n_steps: int = 0
        # Compare replicas of the state across the devices that hold them.
        replicas: bool = True
        # Run due steps twice and compare (costs a second step and a state copy).
        recompute: bool = False
        on_mismatch: Literal["stop", "skip", "log"] = "stop"
        # Replica check before every checkpoint save (when every_n_steps > 0), so no
        # checkpoint is written from disagreeing replicas.
        check_before_save: bool = True

    def __init__(self, cfg: "SdcChecker.Config"):
        super().__init__(cfg)
        if self.config.every_n_steps < 0:
            raise ConfigError(f"sdc.every_n_steps must be >= 0, got {self.config.every_n_steps}")
        self.reports: list[SdcReport] = []

    @property
    def enabled(self) -> bool:
        return self.config.every_n_steps > 0

    def due(self, step: int) -> bool:
        return self.enabled and step % self.config.every_n_steps == 0

    def check_replicas(self, state: Any, step: int) -> Any:
        """Returns `state` (repaired under `skip`); raises SdcError under `stop`."""
        report = SdcReport(step, "replicas", compare_replicas(state))
        self._handle(report)
        if not report.ok and self.config.on_mismatch == "skip":
            state = repair_replicas(state, report.mismatches)
            log.warning("SDC: repaired %d replica slice(s) from their majority at step %d",
                        len(report.mismatches), step)
        return state

    def recompute(
        self,
        step_fn: Callable[[Any, Any], tuple[Any, Any]],
        copy_fn: Callable[[Any], Any],
        state: Any,
        batch: Any,
        step: int,
        *,
        corrupt: Optional[Callable[[Any], Any]] = None,
    ) -> tuple[Any, Any]:
        """Runs `step_fn` (which may donate its state) twice and compares the results.
        `corrupt` (fault injection) is applied to the first result before comparing."""
        skip = self.config.on_mismatch == "skip"
        before = copy_fn(state) if skip else None
        first, _ = step_fn(copy_fn(state), batch)
        if corrupt is not None:
            first = corrupt(first)
        new_state, summaries = step_fn(state, batch)
        report = SdcReport(step, "recompute", compare_trees(first, new_state))
        self._handle(report)
        if not report.ok and skip:
            assert before is not None
            log.warning("SDC: step %d dropped (params and optimizer state kept)", step)
            new_state = dict(before, step=new_state["step"], prng_key=new_state["prng_key"])
        return new_state, summaries

    def _handle(self, report: SdcReport) -> None:
        self.reports.append(report)
        if report.ok:
            log.info("%s", report.describe())
            return
        log.error("%s (policy: %s)", report.describe(), self.config.on_mismatch)
        if self.config.on_mismatch == "stop":
            raise SdcError(report.describe())


__all__ = [
    "Mismatch",
    "SdcChecker",
    "SdcReport",
    "compare_replicas",
    "compare_trees",
    "device_name",
    "flip_bit",
    "flip_bit_in_tree",
    "repair_replicas",
]
