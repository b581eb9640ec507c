"""Automatic parallelism planning: search layouts for a target, compile the promising ones,
keep what fits, rank by predicted step time, print the winner as a mesh rule.

    target = resolve_target("gpu-h100-8x4")
    result = plan(trainer_cfg, target, max_candidates=24)
    print(format_plan(result))        # table + the winning rule, ready to paste

A layout is a mesh shape over `data`, `fsdp`, `model`, `expert` (product = the device count;
with a `pipeline` hook also a `pipeline` axis of 2 or 4 stages, the layer stack turned into
a `PipelineStack` with its own microbatches), a remat policy for the repeated layer (when
the model has one: `model.decoder.transformer.layer` by default, else the module configs
whose `remat_spec` the recipe set; "none" turns remat off), the self-attention
implementation (einsum or blockwise, on every config with `num_heads` and an
`implementation`) and a number of gradient accumulation microbatches
(`learner.num_microbatches`). Each compiled candidate is the experiment's config (mesh rule
and overrides applied) with the layout's modifiers applied on top, compiled by
`jaxlearn.aot.compile.aot_compile`; see there for the memory check and the time model
(predicted step time = max(compute at the stated MFU, collective bytes / link bandwidth),
ranked by that, then by the no-overlap sum, then by memory).

Candidates are pruned when they cannot help (`jaxlearn.aot.space`): the global batch (per
microbatch) must split evenly over the batch axes; a `model`/`expert`/`fsdp` axis must
shard at least one parameter (else it only replicates work); `model` stays within one host
or slice (the fast link) and at most `max_model_parallel`.

Two searches, within `max_candidates` compilations:

- "estimate" (default, `jaxlearn.aot.shortlist`): every layout gets an analytic estimate
  (`jaxlearn.aot.estimate`), calibrated on the baseline's compile; the best estimates are
  compiled one at a time (re-calibrating) until `finalists` fit. A 7B model's step costs
  tens of CPU seconds to compile, an estimate microseconds.
- "compile": the baseline, then
  1. per (model, expert) group, the most-sharded layout (all remaining devices on `fsdp`);
  2. in groups where it fits, the least-sharded layout that still fits (pure data
     parallel, then bisection over `fsdp`), and on multi-host targets `fsdp` = one host,
     `data` across hosts;
  3. in groups where it does not fit, memory savers on it: stronger remat policies, then
     gradient accumulation (with the strongest remat);
  4. with budget left, remat turned off on the best fitting layouts that use it.

Either way the winner is a compiled layout: the printed rule is backed by a real compile.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional, Sequence

import jax

from jaxlearn.aot.compile import aot_compile, batch_shapes, remat_settings
from jaxlearn.aot.estimate import Estimate
from jaxlearn.aot.report import (
    DEFAULT_HBM_UTILIZATION,
    DEFAULT_MFU,
    AOTReport,
    format_table,
    human_bytes,
    human_seconds,
)
from jaxlearn.aot.space import Space
from jaxlearn.aot.target import AOTError, Target
from jaxlearn.config import ConfigBase, visit
from jaxlearn.mesh import (
    GradAccumulationModifier,
    MeshShapeModifier,
    RematPolicyModifier,
    SetMatchingModifier,
    mesh_shape_from_axes,
)

PLAN_AXES = ("data", "fsdp", "model", "expert")
DEFAULT_LAYER_PATH = r"model\.decoder\.transformer\.layer"
DEFAULT_REMAT_POLICIES = ("dots_saveable", "nothing_saveable")
DEFAULT_MICROBATCHES = (1, 2, 4, 8)
DEFAULT_ATTENTION = ("einsum", "blockwise")
DEFAULT_PIPELINE_STAGES = (2, 4)
KEEP = "keep"  # Remat (or attention) as the config has it.
IMPLEMENTATIONS = ("auto", "einsum", "dot_product_attention", "blockwise")
# fn(num_stages, num_microbatches) -> (modifier config turning the layer stack into a
# pipeline, that modifier as Python source for the printed rule); supplied by the caller
# (the aot package does not import the layers).
PipelineHook = Callable[[int, int], tuple[Any, str]]


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Where the planner's non-mesh knobs act: the attention configs whose implementation
    it varies (a path regex) and the hook that pipelines the layer stack."""

    attention_target: Optional[str] = None
    pipeline: Optional[PipelineHook] = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate: mesh axis sizes, remat policy, gradient accumulation.

    `remat` is "keep" (as configured), "none" (off) or a policy name; `baseline` marks the
    config exactly as given (its own mesh shape, remat and microbatches).
    """

    sizes: tuple[tuple[str, int], ...]
    remat: str = KEEP
    num_microbatches: int = 1
    baseline: bool = False
    attention: str = KEEP  # Self-attention `implementation`: "keep", "einsum", "blockwise".
    pipeline_microbatches: int = 0  # With a `pipeline` axis > 1: the schedule's microbatches.

    @property
    def mesh(self) -> dict[str, int]:
        return dict(self.sizes)

    def describe(self) -> str:
        if self.baseline:
            return "baseline (config as given)"
        mesh = " ".join(f"{k}={v}" for k, v in self.sizes if v > 1) or "1 device"
        out = f"{mesh}; remat {self.remat}; microbatches {self.num_microbatches}"
        if self.attention != KEEP:
            out += f"; attention {self.attention}"
        if self.pipeline_microbatches:
            out += f"; pipeline x{self.pipeline_microbatches} microbatches"
        return out


@dataclasses.dataclass
class Candidate:
    """A layout and what compiling it gave (a report, or why it could not compile)."""

    layout: Layout
    report: Optional[AOTReport] = None
    error: Optional[str] = None
    estimate: Optional[Estimate] = None

    @property
    def fits(self) -> bool:
        return self.report is not None and self.report.fits

    def sort_key(self) -> tuple[float, float, float]:
        assert self.report is not None
        t = self.report.train
        return (t.step_seconds, t.step_seconds_no_overlap, float(t.required_bytes))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "layout": self.layout.describe(),
            "mesh": self.layout.mesh,
            "remat": self.layout.remat,
            "num_microbatches": self.layout.num_microbatches,
            "baseline": self.layout.baseline,
            "fits": self.fits,
            "error": self.error,
        }
        if self.estimate is not None:
            out.update(estimated_required_bytes=self.estimate.required_bytes,
                       estimated_step_seconds=self.estimate.step_seconds)
        if self.report is not None:
            t = self.report.train
            out.update(required_bytes=t.required_bytes, usable_hbm_bytes=t.usable_hbm_bytes,
                       flops=t.flops, compute_seconds=t.compute_seconds,
                       comm_seconds=t.comm_seconds, step_seconds=t.step_seconds,
                       step_seconds_no_overlap=t.step_seconds_no_overlap,
                       collective_bytes_fast_link=t.collective_bytes_fast_link,
                       collective_bytes_dcn=t.collective_bytes_dcn,
                       remat_settings=self.report.remat,
                       mesh_compiled=self.report.mesh)
        return out


@dataclasses.dataclass
class PlanResult:
    """Every compiled candidate (in compile order), the winner and its mesh rule."""

    selector: str
    num_devices: int
    candidates: list[Candidate]
    winner: Optional[Candidate]
    rule: Optional[str]
    remat_target: Optional[str]
    max_candidates: int
    pruned: dict[str, int]
    notes: list[str]
    estimated: list[Candidate] = dataclasses.field(default_factory=list)  # Not compiled.

    def ranked(self) -> list[Candidate]:
        fitting = sorted((c for c in self.candidates if c.fits), key=Candidate.sort_key)
        rest = [c for c in self.candidates if not c.fits]
        return fitting + rest

    def to_dict(self) -> dict[str, Any]:
        return {
            "selector": self.selector,
            "num_devices": self.num_devices,
            "max_candidates": self.max_candidates,
            "compiled": len(self.candidates),
            "remat_target": self.remat_target,
            "pruned": self.pruned,
            "candidates": [c.to_dict() for c in self.ranked()],
            "winner": None if self.winner is None else self.winner.to_dict(),
            "mesh_rule": self.rule,
            "estimated_not_compiled": [c.to_dict() for c in self.estimated],
            "notes": self.notes,
        }


# ---- layouts ------------------------------------------------------------------------------


def find_remat_target(cfg: ConfigBase) -> Optional[str]:
    """The regex of the module configs the planner sets remat on: the transformer layer
    when there is one, else the configs whose `remat_spec` is set; None if neither."""
    paths: list[str] = []
    set_paths: list[str] = []

    def enter(path: str, value: Any) -> bool:
        if isinstance(value, ConfigBase) and "remat_spec" in value:
            paths.append(path)
            if value.remat_spec is not None:
                set_paths.append(path)
        return False

    visit(cfg, enter)
    if any(re.fullmatch(DEFAULT_LAYER_PATH, p) for p in paths):
        return DEFAULT_LAYER_PATH
    if set_paths:
        return "|".join(re.escape(p) for p in set_paths)
    return None


def find_attention_target(cfg: ConfigBase) -> Optional[str]:
    """The regex of the attention configs (an `implementation` among IMPLEMENTATIONS and a
    `num_heads`) the planner may switch between einsum and blockwise; None if none."""
    paths: list[str] = []

    def enter(path: str, value: Any) -> bool:
        if isinstance(value, ConfigBase) and "num_heads" in value and \
                getattr(value, "implementation", None) in IMPLEMENTATIONS:
            paths.append(path)
        return False

    visit(cfg, enter)
    return "|".join(re.escape(p) for p in paths) or None


def layout_modifiers(layout: Layout, cfg: ConfigBase, remat_target: Optional[str],
                     knobs: Optional[Knobs] = None) -> list[Any]:
    """The modifier configs that turn the base config into this layout."""
    knobs = knobs or Knobs()
    mods: list[Any] = [MeshShapeModifier.default_config().set(
        mesh_shape=mesh_shape_from_axes(tuple(cfg.mesh_axis_names), **layout.mesh))]
    if layout.attention != KEEP and knobs.attention_target is not None:
        mods.append(SetMatchingModifier.default_config().set(
            target=knobs.attention_target, field="implementation", value=layout.attention))
    if layout.pipeline_microbatches and knobs.pipeline is not None:
        mods.append(knobs.pipeline(layout.mesh["pipeline"], layout.pipeline_microbatches)[0])
    if remat_target is not None and layout.remat != KEEP:
        from jaxlearn.module import RematSpec

        policy = None if layout.remat == "none" else RematSpec(policy=layout.remat)
        mods.append(RematPolicyModifier.default_config().set(
            target=remat_target, field="remat_spec", remat_policy=policy))
    mods.append(GradAccumulationModifier.default_config().set(
        num_microbatches=layout.num_microbatches))
    return mods


def apply_layout(cfg: ConfigBase, layout: Layout, remat_target: Optional[str],
                 knobs: Optional[Knobs] = None) -> ConfigBase:
    """A clone of `cfg` with the layout's modifiers applied."""
    if layout.baseline:
        return cfg.clone()
    out = cfg.clone()
    for mod in layout_modifiers(layout, out, remat_target, knobs):
        out = mod.instantiate()(out)
    return out


def _policy_of(cfg: ConfigBase, remat_target: Optional[str]) -> str:
    if remat_target is None:
        return "none"
    pattern = re.compile(remat_target)
    policies = {v for k, v in remat_settings(cfg).items() if pattern.fullmatch(k)}
    return policies.pop() if len(policies) == 1 else ("none" if not policies else "mixed")


def mesh_rule_literal(selector: str, layout: Layout, cfg: ConfigBase,
                      remat_target: Optional[str], knobs: Optional[Knobs] = None) -> str:
    """The layout as a mesh rule `(regex, [modifiers])`, a Python literal to paste into an
    experiment's `mesh_rules` (names from `jaxlearn.mesh` and `jaxlearn.module`)."""
    sizes = ", ".join(f"{k}={v}" for k, v in layout.sizes if v > 1) or "data=1"
    lines = [f"(\"{selector}\", [", f"    mesh_shape_from_axes({sizes}),"]
    knobs = knobs or Knobs()
    if layout.attention != KEEP and knobs.attention_target is not None:
        lines += ["    SetMatchingModifier.default_config().set(",
                  f"        target=r\"{knobs.attention_target}\", field=\"implementation\",",
                  f"        value={layout.attention!r}),"]
    if layout.pipeline_microbatches and knobs.pipeline is not None:
        text = knobs.pipeline(layout.mesh["pipeline"], layout.pipeline_microbatches)[1]
        lines.append(f"    {text},")
    if remat_target is not None:
        policy = _policy_of(cfg, remat_target) if layout.remat == KEEP else layout.remat
        if policy != "mixed":
            value = "None" if policy == "none" else f"RematSpec(policy={policy!r})"
            lines += [
                "    RematPolicyModifier.default_config().set(",
                f"        target=r\"{remat_target}\", field=\"remat_spec\",",
                f"        remat_policy={value}),",
            ]
    lines.append(f"    GradAccumulationModifier.default_config().set("
                 f"num_microbatches={layout.num_microbatches}),")
    lines.append("]),")
    return "\n".join(lines)


def _as_layout(sizes: dict[str, int], remat: str = KEEP, microbatches: int = 1) -> Layout:
    return Layout(tuple((a, sizes[a]) for a in PLAN_AXES), remat, microbatches)


# ---- search -------------------------------------------------------------------------------


class _Search:
    """The compiled candidates so far, within the budget of `max_candidates`."""

    def __init__(self, cfg: ConfigBase, target: Target, space: Space,
                 remat_target: Optional[str], max_candidates: int,
                 compile_layout: Callable[[ConfigBase], AOTReport],
                 progress: Optional[Callable[[Candidate], None]], knobs: Knobs):
        self.cfg = cfg
        self.knobs = knobs
        self.estimated: list[Candidate] = []  # Estimated, not compiled (best first).
        self.notes: list[str] = []
        self.hbm_utilization = DEFAULT_HBM_UTILIZATION
        self.target = target
        self.space = space
        self.remat_target = remat_target
        self.max_candidates = max_candidates
        self.compile_layout = compile_layout
        self.progress = progress
        self.candidates: list[Candidate] = []
        self.seen: set[Layout] = set()

    def run(self, layout: Layout, estimate: Optional[Estimate] = None) -> Optional[Candidate]:
        """Compiles `layout` unless seen or out of budget (then None)."""
        if layout in self.seen or len(self.candidates) >= self.max_candidates:
            return None
        self.seen.add(layout)
        cand = Candidate(layout, estimate=estimate)
        try:
            cand.report = self.compile_layout(
                apply_layout(self.cfg, layout, self.remat_target, self.knobs))
        except (AOTError, ValueError) as e:
            cand.error = str(e).splitlines()[0][:300]
        self.candidates.append(cand)
        if self.progress is not None:
            self.progress(cand)
        return cand

    def fits(self, layout: Layout) -> bool:
        """Whether `layout` fits, compiling it if it is new and the budget allows."""
        c = self.run(layout)
        if c is None:  # Already compiled, or out of budget.
            prior = next((x for x in self.candidates if x.layout == layout), None)
            return prior is not None and prior.fits
        return c.fits

    def baseline(self) -> None:
        base = self.run(Layout((), baseline=True))
        if base is not None and base.report is not None:
            self.seen.add(_baseline_layout(self.cfg, base))

    def least_sharded_fitting(self, opts: list[dict[str, int]]) -> None:
        """Bisects `opts` (most `fsdp` first, opts[0] fits) for the last one that fits."""
        lo, hi = 0, len(opts) - 1
        if self.fits(_as_layout(opts[hi])):
            return
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(_as_layout(opts[mid])):
                lo = mid
            else:
                hi = mid

    def memory_savers(self, sizes: dict[str, int], policies: Sequence[str],
                      microbatches: Sequence[int]) -> None:
        """Stronger remat policies on `sizes`, then gradient accumulation with the strongest,
        until one fits."""
        for policy in policies:
            if self.fits(_as_layout(sizes, policy)):
                return
        strongest = policies[-1] if policies else KEEP
        for mb in microbatches:
            if mb != 1 and self.space.batch_ok(sizes, mb) and \
                    self.fits(_as_layout(sizes, strongest, mb)):
                return

    def remat_off(self) -> None:
        """Remat turned off on the three best fitting layouts that rematerialise."""
        best = sorted((c for c in self.candidates if c.fits and not c.layout.baseline),
                      key=Candidate.sort_key)[:3]
        for cand in best:
            layout = cand.layout
            current = _policy_of(apply_layout(self.cfg, layout, self.remat_target,
                                              self.knobs), self.remat_target)
            if current != "none":
                self.run(Layout(layout.sizes, "none", layout.num_microbatches))


def plan(
    cfg: ConfigBase,
    target: Target,
    *,
    max_candidates: int = 24,
    mfu: float = DEFAULT_MFU,
    hbm_utilization: float = DEFAULT_HBM_UTILIZATION,
    remat_target: Optional[str] = "auto",
    remat_policies: Sequence[str] = DEFAULT_REMAT_POLICIES,
    microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
    max_model_parallel: int = 16,
    include_baseline: bool = True,
    progress: Optional[Callable[[Candidate], None]] = None,
    search: str = "estimate",
    finalists: int = 2,
    attention: Sequence[str] = DEFAULT_ATTENTION,
    pipeline: Optional[PipelineHook] = None,
    pipeline_stages: Sequence[int] = DEFAULT_PIPELINE_STAGES,
) -> PlanResult:
    """Searches layouts for `target` (see the module doc); at most `max_candidates`
    compilations.

    Args:
        cfg: the trainer config (experiment + mesh rule + overrides).
        target: from `resolve_target` (its `hbm_bytes` is what must fit).
        remat_target: regex of the module configs to set `remat_spec` on; "auto":
            `find_remat_target`; None: do not vary remat.
        remat_policies: policies to try when memory is short, weakest first.
        microbatches: gradient accumulation counts to try when memory is short.
        progress: called with each candidate once compiled.
        search: "estimate" (rank every layout analytically, compile the best until
            `finalists` fit: `jaxlearn.aot.shortlist`) or "compile" (the compile-driven
            search of the module doc).
        attention: self-attention implementations to try (empty: keep the config's).
        pipeline: the hook that pipelines the layer stack (None: no pipeline layouts);
            `pipeline_stages`: the stage counts to try.
    """
    if max_candidates < 1:
        raise AOTError(f"max_candidates must be >= 1, got {max_candidates}")
    if remat_target == "auto":
        remat_target = find_remat_target(cfg)
    batch = {k: jax.ShapeDtypeStruct(shape, dtype)
             for k, (shape, dtype) in batch_shapes(cfg).items()}
    if search not in ("estimate", "compile"):
        raise AOTError(f"search must be 'estimate' or 'compile', got {search!r}")
    space = Space(cfg, target, int(next(iter(batch.values())).shape[0]), max_model_parallel)
    knobs = Knobs(find_attention_target(cfg) if attention else None, pipeline)
    found = _Search(cfg, target, space, remat_target, max_candidates,
                    lambda c: aot_compile(c, target, mfu=mfu,
                                          hbm_utilization=hbm_utilization, batch=batch),
                    progress, knobs)
    found.hbm_utilization = hbm_utilization
    if search == "estimate":
        from jaxlearn.aot.shortlist import shortlist_search

        shortlist_search(found, remat_policies=remat_policies if remat_target else (),
                         microbatches=microbatches, attentions=attention,
                         pipeline_stages=pipeline_stages, finalists=finalists, mfu=mfu,
                         include_baseline=include_baseline)
        return _result(found)
    _compile_search(found, remat_policies, microbatches, include_baseline)
    return _result(found)


def _compile_search(search: _Search, remat_policies: Sequence[str],
                    microbatches: Sequence[int], include_baseline: bool) -> None:
    """The compile-driven search (steps 1-4 of the module doc)."""
    remat_target, space = search.remat_target, search.space
    groups = space.groups()
    if include_baseline:
        search.baseline()
    # 1. The most sharded layout of each (model, expert) group.
    top = {g: _as_layout(opts[0]) for g, opts in groups.items()}
    for layout in top.values():
        search.run(layout)
    # 2. Where it fits: the least-sharded layout that still fits, and on multi-host targets
    # fsdp over one host, data across hosts.
    for g, opts in groups.items():
        if search.fits(top[g]) and len(opts) >= 2:
            search.least_sharded_fitting(opts)
            _one_host_fsdp(search, g, opts)
    # 3. Where even that does not fit: remat, then gradient accumulation.
    policies = list(remat_policies) if remat_target is not None else []
    for g, opts in groups.items():
        if not search.fits(top[g]):
            search.memory_savers(opts[0], policies, microbatches)
    # 4. Remat off where a fitting layout rematerialises.
    if remat_target is not None:
        search.remat_off()


def _one_host_fsdp(search: _Search, group: tuple[int, int],
                   opts: list[dict[str, int]]) -> None:
    if search.target.num_granules > 1:
        per = search.space.per_granule
        host = next((o for o in opts if o["fsdp"] * group[0] * group[1] == per), None)
        if host is not None:
            search.run(_as_layout(host))


def _result(search: _Search) -> PlanResult:
    """The winner (fastest fitting candidate) and its mesh rule."""
    cfg, target, remat_target = search.cfg, search.target, search.remat_target
    notes: list[str] = list(search.notes)
    if len(search.candidates) >= search.max_candidates:
        notes.append(f"stopped at max_candidates={search.max_candidates}; raise it to "
                     "search more")
    fitting = sorted((c for c in search.candidates if c.fits), key=Candidate.sort_key)
    winner = fitting[0] if fitting else None
    rule = None
    if winner is not None:
        if winner.layout.baseline:
            notes.append("the config as given is the best layout found")
            as_layout = _baseline_layout(cfg, winner)
            if not as_layout.baseline:
                rule = mesh_rule_literal(target.selector, as_layout, cfg, remat_target)
        else:
            rule = mesh_rule_literal(target.selector, winner.layout, cfg, remat_target,
                                     search.knobs)
    return PlanResult(target.selector, target.num_devices, search.candidates, winner, rule,
                      remat_target, search.max_candidates, search.space.pruned, notes,
                      search.estimated)


def _baseline_layout(cfg: ConfigBase, cand: Candidate) -> Layout:
    """The layout the baseline is (the planner never varies its other mesh axes)."""
    assert cand.report is not None
    mesh = cand.report.mesh
    if any(v > 1 for k, v in mesh.items() if k not in PLAN_AXES):
        return Layout((), baseline=True)
    sizes = tuple((a, int(mesh.get(a, 1))) for a in PLAN_AXES)
    return Layout(sizes, KEEP, int(cfg.learner.num_microbatches))


# ---- printing -----------------------------------------------------------------------------


def format_plan(result: PlanResult) -> str:
    """The ranked table and the winning mesh rule."""
    rows = [["#", "layout", "fits", "required", "usable HBM", "t_compute", "t_comm", "t_step"]]
    for i, c in enumerate(result.ranked(), 1):
        if c.report is None:
            rows.append([str(i), c.layout.describe(), "error", "-", "-", "-", "-",
                         (c.error or "")[:60]])
            continue
        t = c.report.train
        rows.append([str(i), c.layout.describe(), "yes" if c.fits else "NO",
                     human_bytes(t.required_bytes), human_bytes(t.usable_hbm_bytes),
                     human_seconds(t.compute_seconds), human_seconds(t.comm_seconds),
                     human_seconds(t.step_seconds)])
    lines = [f"plan for {result.selector} ({result.num_devices} devices): "
             f"{len(result.candidates)} candidate(s) compiled (max {result.max_candidates})",
             "", format_table(rows), ""]
    if result.estimated:
        rows = [["#", "estimated, not compiled", "est. required", "est. t_step"]]
        for i, c in enumerate(result.estimated, 1):
            assert c.estimate is not None
            rows.append([str(i), c.layout.describe(), human_bytes(c.estimate.required_bytes),
                         human_seconds(c.estimate.step_seconds)])
        lines += [format_table(rows), ""]
    if result.pruned:
        lines.append("pruned before compiling: " + "; ".join(
            f"{v} x {k}" for k, v in sorted(result.pruned.items())))
    lines.append(f"remat target: {result.remat_target or '(none: remat not varied)'}")
    for note in result.notes:
        lines.append(f"note: {note}")
    if result.winner is None:
        lines.append("no candidate fits the target's memory")
    else:
        lines += ["", f"winner: {result.winner.layout.describe()}",
                  "mesh rule (put it before the rules it should override; uses "
                  "names from jaxlearn.mesh, jaxlearn.module.RematSpec and, for a "
                  "pipeline, jaxlearn.layers.{ScanStack, pipeline.pipeline_config}):",
                  result.rule or ""]
    return "\n".join(lines)


__all__ = [
    "DEFAULT_MICROBATCHES",
    "DEFAULT_REMAT_POLICIES",
    "Candidate",
    "Layout",
    "PlanResult",
    "apply_layout",
    "find_remat_target",
    "format_plan",
    "layout_modifiers",
    "mesh_rule_literal",
    "plan",
]
