"""Reading a compiled (optimised, SPMD-partitioned) HLO module's text: collectives and
matmul FLOPs, weighted by how often each computation runs per step.

`compiled.cost_analysis()` counts the body of a `while` loop once, whatever its trip count,
so a model whose layers run under `lax.scan` (or a step with gradient accumulation) looks
`num_layers` (or `num_microbatches`) times cheaper than it is. This module parses
`compiled.as_text()`, finds each computation's executions per step (a `while` body runs
`known_trip_count` times, as XLA records in the loop's backend_config; unknown counts are
taken as 1 and reported), and from that:

- FLOPs, static (each instruction once, what cost_analysis sees) and per step (times
  executions): 2 * prod(result) * prod(contracted lhs dims) per `dot`, one per result
  element of elementwise arithmetic, one per input element of `reduce`, and for a
  `convolution` (how the TPU compiler emits matmuls) 2 * output elements * kernel
  elements per output feature (custom calls and sort are not counted); `aot` scales
  XLA's figure by `per_step / static`. Loops without a recorded trip count (the TPU
  compiler records none) get it from their condition `i < constant(N)`;
- collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute and
  their async `-start` forms; `-done` is not counted): per kind the instruction count, the
  executions per step, and the bytes each device sends under ring algorithms:

      all-reduce          2 (S-1)/S * B      B = operand bytes, S = group size
      all-gather          (S-1) * B          B = the operand (one shard)
      reduce-scatter      (S-1)/S * B        B = the full operand
      all-to-all          (S-1)/S * B
      collective-permute  B

  and whether a collective's groups span more than one granule (a host or slice: devices
  joined by the fast link), in which case its bytes go over the data-centre network.

Device ids in replica groups index the executable's device assignment, which for a jit
over a mesh is `mesh.devices.flat`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Optional, Sequence

import numpy as np

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
    "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "token": 0,
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLED_LIST = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


# Opcodes counted as one FLOP per result element (as XLA's cost analysis does).
_ELEMENTWISE = frozenset(
    "add subtract multiply divide maximum minimum compare select negate abs exponential "
    "exponential-minus-one log log-plus-one tanh logistic rsqrt sqrt cbrt power remainder "
    "sign floor ceil round-nearest-even round-nearest-afz clamp atan2 sine cosine tan erf "
    "and or xor not".split()
)


def dtype_bytes(dtype: str) -> float:
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    m = re.match(r"[a-z]+(\d+)", dtype)  # f8e4m3fn, f8e5m2, ...
    return int(m.group(1)) / 8 if m else 4


def shape_bytes(shape_text: str) -> float:
    """Bytes of an HLO shape (arrays and tuples of arrays; layouts ignored)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape_text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * dtype_bytes(dtype)
    return total


def _dims(shape_text: str) -> list[int]:
    m = _ARRAY.search(shape_text)
    if not m or not m.group(2):
        return []
    return [int(d) for d in m.group(2).split(",")]


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at `text[start]`."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[text[start]]]
    i = start + 1
    while i < len(text) and stack:
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif ch == stack[-1]:
            stack.pop()
        i += 1
    return i


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


@dataclasses.dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: list[Instruction]


def _parse_instruction(line: str) -> Optional[Instruction]:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    opcode = om.group(1)
    end = _balanced(rest, om.end() - 1)
    operand_text = rest[om.end():end - 1]
    operands = []
    depth, cur = 0, ""
    for ch in operand_text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            operands.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        operands.append(cur.strip())
    return Instruction(name, shape, opcode, operands, rest[end:])


def parse_module(text: str) -> dict[str, Computation]:
    """Computations by name from `compiled.as_text()` (or any HLO module text)."""
    comps: dict[str, Computation] = {}
    current: Optional[Computation] = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line.strip())
            if m:
                current = Computation(m.group(2), bool(m.group(1)), [])
            continue
        if line.strip() == "}":
            comps[current.name] = current
            current = None
            continue
        instr = _parse_instruction(line)
        if instr is not None:
            current.instructions.append(instr)
    return comps


def _called(instr: Instruction) -> list[tuple[str, str]]:
    out = [(k, v) for k, v in _CALLED.findall(instr.attrs)]
    for key, names in _CALLED_LIST.findall(instr.attrs):
        out += [(key, n.strip().lstrip("%")) for n in names.split(",") if n.strip()]
    return out


def _trip_from_condition(comps: dict[str, Computation], instr: Instruction
                         ) -> Optional[float]:
    """Trip count of a counted loop whose backend_config lacks one (the TPU compiler does
    not record it): the condition is `compare(i, constant(N)), direction=LT` on an integer
    induction variable, which `lax.scan`/`fori_loop` start at 0 and step by 1."""
    m = re.search(r"\bcondition=%?([\w.\-]+)", instr.attrs)
    cond = comps.get(m.group(1)) if m else None
    if cond is None:
        return None
    consts: dict[str, float] = {}
    for i in cond.instructions:
        if i.opcode == "constant" and re.match(r"[su](8|16|32|64)\[\]", i.shape):
            cm = re.fullmatch(r"-?\d+", i.operands[0] if i.operands else "")
            if cm:
                consts[i.name] = float(i.operands[0])
    for i in reversed(cond.instructions):
        if i.opcode == "compare" and "direction=LT" in i.attrs and len(i.operands) == 2:
            bound = consts.get(i.operands[1].split()[-1].lstrip("%"))
            if bound is not None and bound >= 0:
                return bound
    return None


def executions(comps: dict[str, Computation]) -> tuple[dict[str, float], int]:
    """Per computation, how many times it runs per call of the entry computation; and the
    number of `while` loops whose trip count XLA did not record (taken as 1)."""
    edges: dict[str, list[tuple[str, float]]] = {name: [] for name in comps}
    unknown = 0
    for comp in comps.values():
        for instr in comp.instructions:
            trip = 1.0
            if instr.opcode == "while":
                m = _TRIP.search(instr.attrs)
                guessed = _trip_from_condition(comps, instr)
                if m:
                    trip = float(m.group(1))
                elif guessed is not None:
                    trip = guessed
                else:
                    unknown += 1
            for key, callee in _called(instr):
                if callee in comps:
                    edges[comp.name].append((callee, trip if key == "body" else 1.0))
    indeg = {name: 0 for name in comps}
    for outs in edges.values():
        for callee, _ in outs:
            indeg[callee] += 1
    mult = {name: (1.0 if c.is_entry else 0.0) for name, c in comps.items()}
    ready = [name for name, d in indeg.items() if d == 0]
    while ready:
        name = ready.pop()
        for callee, factor in edges[name]:
            mult[callee] += mult[name] * factor
            indeg[callee] -= 1
            if indeg[callee] == 0:
                ready.append(callee)
    return mult, unknown


def _conv_flops(instr: Instruction, symbols: dict[str, str]) -> float:
    """2 * output elements * kernel elements per output feature / feature groups (the TPU
    compiler lowers matmuls to convolutions)."""
    kernel = _dims(_operand_shape(instr.operands[1], symbols))
    labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
    if not kernel or not labels or len(labels.group(1)) != len(kernel):
        return 0.0
    o = labels.group(1).find("o")
    per_output = math.prod(kernel) / (kernel[o] if o >= 0 else 1)
    groups = re.search(r"feature_group_count=(\d+)", instr.attrs)
    per_output /= int(groups.group(1)) if groups else 1
    return 2.0 * math.prod(_dims(instr.shape) or [1]) * per_output


def _operand_shape(operand: str, symbols: dict[str, str]) -> str:
    """An operand's shape: inline (`f32[2,3]{1,0} %x`) or from the symbol table."""
    if _ARRAY.match(operand) or operand.startswith("("):
        return operand.rsplit(" ", 1)[0]
    return symbols.get(operand.lstrip("%"), "")


_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\]"
    r"(?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?\s*\{([^}]*)\}"
)


def _mesh_groups(m: re.Match) -> list[list[int]]:
    """Groups of the mesh-axes form `mesh['axis_0'=2,'axis_1'=8] [, device_ids=([8,2]T(1,0))]
    {'axis_1'}`: devices that differ only along the listed axes communicate."""
    axes = re.findall(r"'?([\w.]+)'?\s*=\s*(\d+)", m.group(1))
    names = [a for a, _ in axes]
    sizes = [int(n) for _, n in axes]
    total = math.prod(sizes)
    ids = np.arange(total)
    if m.group(2):
        ids = ids.reshape([int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    ids = ids.reshape(sizes)
    comm = [names.index(a) for a in re.findall(r"'?([\w.]+)'?", m.group(4)) if a in names]
    rest = [i for i in range(len(names)) if i not in comm]
    group = math.prod(sizes[i] for i in comm)
    return [list(map(int, g)) for g in ids.transpose(rest + comm).reshape(-1, group)]


def _replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
    mm = _MESH_GROUPS.search(attrs)
    if mm:
        return _mesh_groups(mm)
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", attrs)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return [list(map(int, g)) for g in ids.reshape(shape[0], -1)]
    m = re.search(r"replica_groups=\{", attrs)
    if m:
        end = _balanced(attrs, m.end() - 1)
        body = attrs[m.end():end - 1]
        groups = [[int(x) for x in g.split(",") if x.strip()]
                  for g in re.findall(r"\{([^{}]*)\}", body)]
        groups = [g for g in groups if g]
        if groups:
            return groups
    return [list(range(num_devices))]


def _permute_pairs(attrs: str) -> list[list[int]]:
    m = re.search(r"source_target_pairs=\{", attrs)
    if not m:
        return []
    end = _balanced(attrs, m.end() - 1)
    return [[int(x) for x in p.split(",")] for p in
            re.findall(r"\{([0-9]+,[0-9]+)\}", attrs[m.end() - 1:end])]


def _sent_bytes(kind: str, operand_bytes: float, group_size: int) -> float:
    s = max(group_size, 1)
    if kind == "all-reduce":
        return 2.0 * (s - 1) / s * operand_bytes
    if kind == "all-gather":
        return (s - 1) * operand_bytes
    if kind in ("reduce-scatter", "all-to-all"):
        return (s - 1) / s * operand_bytes
    return operand_bytes  # collective-permute


@dataclasses.dataclass
class CollectiveStats:
    """One collective kind: instructions, executions per step, bytes each device sends."""

    count: int = 0
    executions: float = 0.0
    bytes_fast: float = 0.0
    bytes_slow: float = 0.0

    @property
    def bytes(self) -> float:
        return self.bytes_fast + self.bytes_slow


@dataclasses.dataclass
class HloStats:
    """What `analyze_hlo` read from a module."""

    collectives: dict[str, CollectiveStats]
    flops_static: float
    flops_per_step: float
    unknown_trip_counts: int
    while_loops: int

    @property
    def collective_bytes_fast(self) -> float:
        return sum(c.bytes_fast for c in self.collectives.values())

    @property
    def collective_bytes_slow(self) -> float:
        return sum(c.bytes_slow for c in self.collectives.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "collectives": {
                k: {"count": v.count, "executions": v.executions, "bytes": v.bytes,
                    "bytes_fast_link": v.bytes_fast, "bytes_dcn": v.bytes_slow}
                for k, v in self.collectives.items()
            },
            "flops_static": self.flops_static,
            "flops_per_step": self.flops_per_step,
            "unknown_trip_counts": self.unknown_trip_counts,
            "while_loops": self.while_loops,
        }


def _collective_kind(opcode: str) -> Optional[str]:
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVE_KINDS else None


def analyze_hlo(
    text: str,
    num_devices: int,
    granule_of: Optional[Callable[[int], int]] = None,
) -> HloStats:
    """Collectives and dot FLOPs of an HLO module text.

    Args:
        text: `compiled.as_text()`.
        num_devices: the number of devices of the executable (for `replica_groups={}`).
        granule_of: logical device id -> granule (host/slice) index; None: one granule.
    """
    comps = parse_module(text)
    mult, unknown = executions(comps)
    stats = {k: CollectiveStats() for k in COLLECTIVE_KINDS}
    fl_static = fl_step = 0.0
    whiles = 0
    for comp in comps.values():
        symbols = {i.name: i.shape for i in comp.instructions}
        m = mult.get(comp.name, 0.0)
        for instr in comp.instructions:
            if instr.opcode == "while":
                whiles += 1
            if instr.opcode in _ELEMENTWISE:
                flops = float(math.prod(_dims(instr.shape) or [1]))
                fl_static += flops
                fl_step += flops * m
                continue
            if instr.opcode == "reduce" and instr.operands:
                flops = float(math.prod(_dims(_operand_shape(instr.operands[0], symbols)) or [1]))
                fl_static += flops
                fl_step += flops * m
                continue
            if instr.opcode == "convolution" and len(instr.operands) == 2:
                flops = _conv_flops(instr, symbols)
                fl_static += flops
                fl_step += flops * m
                continue
            if instr.opcode == "dot" and instr.operands:
                lhs = _dims(_operand_shape(instr.operands[0], symbols))
                cm = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.attrs)
                contracted = [int(d) for d in cm.group(1).split(",") if d] if cm else []
                k = math.prod(lhs[d] for d in contracted if d < len(lhs))
                flops = 2.0 * math.prod(_dims(instr.shape) or [1]) * k
                fl_static += flops
                fl_step += flops * m
                continue
            kind = _collective_kind(instr.opcode)
            if kind is None:
                continue
            operand_bytes = sum(shape_bytes(_operand_shape(o, symbols)) for o in instr.operands)
            if kind == "collective-permute":
                pairs = _permute_pairs(instr.attrs)
                group = 2
                members = pairs
            else:
                members = _replica_groups(instr.attrs, num_devices)
                group = max((len(g) for g in members), default=1)
            sent = _sent_bytes(kind, operand_bytes, group) * m
            slow = granule_of is not None and any(
                len({granule_of(d) for d in g}) > 1 for g in members
            )
            st = stats[kind]
            st.count += 1
            st.executions += m
            if slow:
                st.bytes_slow += sent
            else:
                st.bytes_fast += sent
    return HloStats(stats, fl_static, fl_step, unknown, whiles)


def granule_lookup(flat_devices: Sequence[Any], granule_of_device: Callable[[Any], int]
                   ) -> Callable[[int], int]:
    """logical id -> granule, for an executable whose device assignment is `flat_devices`."""
    table = [granule_of_device(d) for d in flat_devices]
    return lambda i: table[i] if 0 <= i < len(table) else -1


__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveStats",
    "HloStats",
    "analyze_hlo",
    "executions",
    "granule_lookup",
    "parse_module",
    "shape_bytes",
]
