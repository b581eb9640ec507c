"""LoRA adapters served together on one base model (`Engine.Config.max_loras` > 0).

The engine swaps the `lora_targets` projections for `layers.MultiLoraLinear` (a `Linear`
with adapter banks of `max_loras + 1` slots of rank `max_lora_rank`; slot 0: none) at
build. `AdapterBanks` is the registry of what is loaded: `load` converts an adapter's
params (the `LoraLinear` layout of a jaxlearn LoRA run) into bank entries zero-padded to
the max rank and writes them into a free slot of the runner's params (device arrays of
fixed shapes: no program is recompiled), `unload` zeroes the slot.

A request names its adapter (`SamplingParams.adapter`; None: the base model). The
scheduler resolves the name when it makes the request (`resolve`: an unknown name is a
`RequestError` on the `model` field, the OpenAI field that names what serves a request)
and each call passes the slot of every row to the runner (`request.sampling_lists`
"adapter"), which hands them to the model as a side input (`layers.multi_lora`). Each
load gets a fresh prefix-cache salt (`Adapter.salt`): the digest chain of a request's
pages starts from it, so cached pages of one adapter never serve another, the base model,
or a later adapter loaded into the same slot or under the same name.

Unloading an adapter that queued or running requests use is refused (`InferenceError`
naming them); a request made before the unload and submitted after it is refused at
submission (`RequestError` on `model`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
import threading
from typing import Any, Iterable, Optional

from jaxlearn.inference.errors import InferenceError, RequestError
from jaxlearn.layers.multi_lora import adapter_arrays, bank_layers, write_adapter

_loads = itertools.count(1)


@dataclasses.dataclass(eq=False)
class Adapter:
    """One loaded adapter: its bank slot, rank, alpha and prefix-cache salt."""

    name: str
    slot: int
    rank: int
    alpha: float
    salt: bytes
    loaded: bool = True


def check_adapter_settings(cfg: Any) -> None:
    """The `Engine.Config` LoRA fields (each error names the field)."""
    for name, low in (("max_loras", 0), ("max_lora_rank", 1)):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"Engine.Config.{name}={value!r}: must be an int >= {low}")
    try:
        re.compile(cfg.lora_targets)
    except (re.error, TypeError) as e:
        raise ValueError(f"Engine.Config.lora_targets={cfg.lora_targets!r}: {e}") from None
    if cfg.max_loras and cfg.fuse_projections:
        raise ValueError(f"Engine.Config.max_loras={cfg.max_loras} needs fuse_projections="
                         f"False (adapters are per projection)")


def resolve_adapter(banks: Optional["AdapterBanks"], name: Optional[str]) -> Optional[Adapter]:
    """The adapter a request's `SamplingParams.adapter` names (None: the base model)."""
    if name is None:
        return None
    if banks is None or not banks.max_loras:
        raise RequestError(f"model {name!r}: this engine serves no LoRA adapters "
                           f"(Engine.Config.max_loras=0)", param="model")
    return banks.resolve(name)


def check_loaded(adapter: Optional[Adapter]) -> None:
    """Refuses a request whose adapter was unloaded after the request was made."""
    if adapter is not None and not adapter.loaded:
        raise RequestError(f"model {adapter.name!r}: the LoRA adapter was unloaded",
                           param="model")


class AdapterBanks:
    """The adapters loaded into the runner's banks (module docstring). `runner`: a
    `ModelRunner` whose model has `MultiLoraLinear`s of `max_loras + 1` slots."""

    def __init__(self, runner: Any, max_loras: int, max_rank: int):
        self.runner = runner
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._by_name: dict[str, Adapter] = {}
        self._lock = threading.Lock()
        if max_loras and not bank_layers(runner.model):
            raise ValueError("AdapterBanks: the model has no MultiLoraLinear layer")

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def resolve(self, name: str) -> Adapter:
        """The loaded adapter `name` (RequestError on `model` if there is none)."""
        with self._lock:
            adapter = self._by_name.get(name)
        if adapter is None:
            served = ", ".join(sorted(self._by_name)) or "none"
            raise RequestError(f"model {name!r}: no such LoRA adapter is loaded (loaded: "
                               f"{served})", param="model")
        return adapter

    def arrays(self, rank: int, alpha: float, params: Any) -> Any:
        """Host bank entries of an adapter (`layers.multi_lora.adapter_arrays`)."""
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"adapter rank must be an int >= 1, got {rank!r}")
        if rank > self.max_rank:
            raise ValueError(f"adapter rank {rank} exceeds Engine.Config.max_lora_rank="
                             f"{self.max_rank}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
            raise ValueError(f"adapter alpha must be > 0, got {alpha!r}")
        return adapter_arrays(self.runner.model, self.runner.params, params, rank=rank,
                              alpha=float(alpha))

    def load(self, name: str, rank: int, alpha: float, arrays: Any) -> Adapter:
        """Writes `arrays` (from `arrays`) into a free slot under `name`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name must be a non-empty string, got {name!r}")
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"adapter {name!r} is already loaded (unload it first)")
            used = {a.slot for a in self._by_name.values()}
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if not free:
                raise ValueError(f"all Engine.Config.max_loras={self.max_loras} adapter "
                                 f"slots are in use ({', '.join(sorted(self._by_name))})")
            salt = hashlib.sha256(f"lora\0{name}\0{next(_loads)}".encode()).digest()
            adapter = Adapter(name, free[0], rank, float(alpha), salt)
            self.runner.params = write_adapter(self.runner.params, arrays, adapter.slot)
            self._by_name[name] = adapter
            return adapter

    def unload(self, name: str, pending: Iterable[Any]) -> None:
        """Zeroes the slot of `name` unless a request of `pending` (the queued and
        running ones) uses it; the caller holds the scheduler's locks."""
        with self._lock:
            adapter = self._by_name.get(name)
            if adapter is None:
                raise ValueError(f"adapter {name!r} is not loaded")
            users = [r.request_id for r in pending if r.adapter is adapter]
            if users:
                raise InferenceError(
                    f"adapter {name!r} is in use by {len(users)} queued or running "
                    f"request(s) ({', '.join(users[:4])}); unload it when they have finished")
            # No adapter params: every layer's entry is zeros.
            zeros = adapter_arrays(self.runner.model, self.runner.params, {}, rank=1,
                                   alpha=1.0)
            self.runner.params = write_adapter(self.runner.params, zeros, adapter.slot)
            adapter.loaded = False
            del self._by_name[name]
