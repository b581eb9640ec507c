"""The planner's default search: estimate every layout, compile only the best.

Every layout of the space (each valid mesh, optionally pipelined over `pipeline` stages;
each remat option; each attention implementation; each gradient accumulation count that
splits the batch) gets an analytic estimate (`jaxlearn.aot.estimate`), which costs
microseconds where a compile of a 7B model's step costs tens of seconds. The baseline (the
config as given) is compiled first and calibrates the estimate: the optimizer state per
parameter byte and the temporaries per token that the formulas cannot know. Then the best
estimated layout is compiled, the calibration updated from it, the rest re-ranked, and so
on until `finalists` compiled layouts fit (or the budget or three misses run out). The
winner is the fastest compiled layout that fits, so the printed rule is always backed by
a real compile.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

from jaxlearn.aot.estimate import Calibration, Estimate, ModelShape, estimate, model_shape
from jaxlearn.aot.plan import (
    KEEP,
    PLAN_AXES,
    Candidate,
    Layout,
    _baseline_layout,
    _policy_of,
    _Search,
)
from jaxlearn.aot.space import Space

MAX_MISSES = 3  # Compiled estimated-best layouts that did not fit before giving up.
SHOWN = 8  # Estimated layouts listed (not compiled) in the result.


def attention_at_train_seq(cfg: Any, attention: Any) -> str:
    """The implementation `attention` (an attention config) runs at the training sequence
    length: the layer config's own `implementation_at` (which resolves "auto"), or its
    `implementation` as written for configs without one."""
    resolve = getattr(attention, "implementation_at", None)
    if resolve is None:
        return str(attention.implementation)
    return str(resolve(int(getattr(getattr(cfg, "input", None), "seq_len", 0))))


def _current_attention(cfg: Any, target: Optional[str]) -> str:
    if target is None:
        return "einsum"
    import re

    from jaxlearn.config import ConfigBase, visit

    found: list[str] = []
    pattern = re.compile(target)

    def enter(path: str, value: Any) -> bool:
        if isinstance(value, ConfigBase) and pattern.fullmatch(path):
            found.append(attention_at_train_seq(cfg, value))
        return False

    visit(cfg, enter)
    return found[0] if found else "einsum"


class _Estimator:
    def __init__(self, search: _Search, mfu: float):
        self.search = search
        cfg = search.cfg
        self.shape: ModelShape = model_shape(cfg, search.space.param_specs,
                                             search.space.global_batch)
        self.cal = Calibration()
        self.mfu = mfu
        self.remat = _policy_of(cfg, search.remat_target)
        self.attention = _current_attention(cfg, search.knobs.attention_target)
        self.usable = int(search.target.hbm_bytes * search.hbm_utilization)

    def __call__(self, layout: Layout) -> Estimate:
        remat = self.remat if layout.remat == KEEP else layout.remat
        attention = self.attention if layout.attention == KEEP else layout.attention
        return estimate(self.shape, layout.mesh, self.search.space.rules, self.search.target,
                        remat=remat, attention=attention, microbatches=layout.num_microbatches,
                        pipeline_microbatches=max(1, layout.pipeline_microbatches),
                        calibration=self.cal, mfu=self.mfu)

    def calibrate(self, cand: Candidate, layout: Layout) -> None:
        """Optimizer state and temporaries from a compiled candidate."""
        if cand.report is None:
            return
        train = cand.report.train
        parts = train.state_breakdown
        if parts.get("params"):
            self.cal.opt_bytes_per_param_byte = (sum(parts.values()) - parts["params"]) / \
                parts["params"]
        floor = self(layout).floor_bytes
        tokens = self.tokens(layout) // layout.mesh.get("model", 1)
        self.cal.temp_points.append((tokens, float(train.required_bytes - floor)))

    def tokens(self, layout: Layout) -> int:
        """Tokens per device in one gradient accumulation microbatch."""
        sizes = layout.mesh
        shards = sizes.get("data", 1) * sizes.get("fsdp", 1) * sizes.get("expert", 1)
        n = self.shape.global_batch * max(1, self.shape.seq_len)
        return n // max(1, shards * layout.num_microbatches * sizes.get("seq", 1))


def layouts(search: _Search, shape: ModelShape, remat: Sequence[str],
            microbatches: Sequence[int], attentions: Sequence[str],
            stages: Sequence[int]) -> Iterator[Layout]:
    """Every layout of the space (see the module doc)."""
    space, target = search.space, search.target
    for s in [1, *stages]:
        if s > 1 and (search.knobs.pipeline is None or target.num_devices % s
                      or not shape.num_layers or shape.num_layers % s):
            continue
        sub = space if s == 1 else Space(search.cfg, target, space.global_batch,
                                         space.max_model, num_devices=target.num_devices // s,
                                         param_specs=space.param_specs)
        for options in sub.groups().values():
            for sizes in options:
                yield from _variants(sub, sizes, s, remat, microbatches, attentions)


def _variants(space: Space, sizes: dict[str, int], stages: int, remat: Sequence[str],
              microbatches: Sequence[int], attentions: Sequence[str]) -> Iterator[Layout]:
    axes = tuple((a, sizes[a]) for a in PLAN_AXES)
    if stages > 1:
        axes = (("pipeline", stages),) + axes
    for mb in sorted({1, *microbatches}):
        if not space.batch_ok(sizes, mb):
            continue
        pipe = 0
        if stages > 1:
            rows = space.global_batch // mb
            pipe = next((m for m in (4 * stages, 2 * stages, stages)
                         if rows % (m * space.batch_shards(sizes)) == 0), 0)
            if not pipe:
                continue
        for r in remat:
            for a in attentions:
                yield Layout(axes, r, mb, attention=a, pipeline_microbatches=pipe)


def shortlist_search(search: _Search, *, remat_policies: Sequence[str],
                     microbatches: Sequence[int], attentions: Sequence[str],
                     pipeline_stages: Sequence[int], finalists: int, mfu: float,
                     include_baseline: bool) -> None:
    """Fills `search.candidates` (compiled) and `search.estimated` (see the module doc)."""
    est = _Estimator(search, mfu)
    remat = [KEEP] + ([*remat_policies, "none"] if search.remat_target is not None else [])
    atts = [KEEP] + [a for a in attentions if a != est.attention] \
        if search.knobs.attention_target is not None else [KEEP]
    pool = list(dict.fromkeys(layouts(search, est.shape, remat, microbatches, atts,
                                      pipeline_stages)))
    if include_baseline:
        search.baseline()
        if search.candidates and search.candidates[0].report is not None:
            base = search.candidates[0]
            base.estimate = est(_baseline_layout(search.cfg, base))
            est.calibrate(base, _baseline_layout(search.cfg, base))
    fitting, misses = 0, 0
    while fitting < finalists and misses < MAX_MISSES and \
            len(search.candidates) < search.max_candidates:
        ranked = _rank([lay for lay in pool if lay not in search.seen], est)
        if not ranked:
            break
        layout, e = ranked[0]
        cand = search.run(layout, e)
        if cand is None:
            break
        est.calibrate(cand, layout)
        if cand.fits:
            fitting += 1
        else:
            misses += 1
    rest = _rank([lay for lay in pool if lay not in search.seen], est)
    search.estimated = [Candidate(lay, estimate=e) for lay, e in rest[:SHOWN]]
    search.notes.append(f"{len(pool)} layouts estimated, {len(search.candidates)} compiled")


def _rank(pool: list[Layout], est: _Estimator) -> list[tuple[Layout, Estimate]]:
    scored = [(lay, est(lay)) for lay in pool]
    def key(le: tuple[Layout, Estimate]) -> tuple[bool, float, int]:
        e = le[1]
        if e.required_bytes <= est.usable:  # Fitting first, fastest first.
            return (False, e.step_seconds, e.required_bytes)
        return (True, float(e.required_bytes), 0)  # Then the closest to fitting.

    return sorted(scored, key=key)


__all__ = ["layouts", "shortlist_search"]
