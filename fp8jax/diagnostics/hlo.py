"""Reading compiled HLO text: the collectives a program runs and the bytes each device sends.

``collectives(hlo_text, num_devices)`` lists every all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute of a compiled module (``jax.jit(f).lower(...).compile()
.as_text()``) with its element type, its result bytes, its replica group's size, how often it
runs per call (inside while loops: the trip count) and the bytes one device sends under ring
costs. ``bytes_summary`` adds those up; ``fp8_collectives_in_stablehlo`` reads the element types
of a lowered (not yet compiled) module's FP8 collectives.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "DTYPE_BYTES",
    "bytes_summary",
    "collectives",
    "computations",
    "executions",
    "fp8_collectives_in_stablehlo",
]

# Bytes per element of HLO's element types.
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP_RE = re.compile(
    r"=\s*(?P<type>\(.*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(_COLLECTIVES) + r")(?P<start>-start)?\("
)
_SHAPE_RE = re.compile(r"(\w+)\[([\d,]*)\]")


def _group_size(line: str, num_devices: int) -> int:
    """Devices per replica group of a collective (all devices when the groups are empty)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:  # replica_groups=mesh['a'=2,'b'=4] {'b'}: groups span the named mesh axes
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"replica_groups=\{(\{[^}]*\})", line)
    if m:
        return len([x for x in m.group(1).strip("{}").split(",") if x.strip()])
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    return num_devices


_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALL_RE = re.compile(r"(?:to_apply|calls|body|condition|branch_computations)=\{?%?([\w.\-]+)")


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """HLO text split into computations (name -> lines) and the entry computation's name."""
    comps, entry, name = {}, "", None
    for line in hlo_text.splitlines():
        m = _COMP_RE.match(line)
        if m and not line.startswith(" "):
            name = m.group(2)
            comps[name] = []
            if m.group(1):
                entry = name
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps, entry


def executions(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How often each computation runs per call of the entry (while bodies x trip count)."""
    runs = {entry: 1}
    todo = [entry]
    while todo:
        comp = todo.pop()
        for line in comps.get(comp, []):
            trips = 1
            if " while(" in line:
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                trips = int(m.group(1)) if m else 1
            for callee in _CALL_RE.findall(line):
                if callee in comps and callee not in runs:
                    runs[callee] = runs[comp] * (trips if f"body=%{callee}" in line else 1)
                    todo.append(callee)
    return runs


def collectives(hlo_text: str, num_devices: int) -> list[dict]:
    """Collectives of a compiled HLO module with the bytes each device sends per step."""
    # Per row: op, element type, result bytes, group size, runs per step (inside while loops:
    # the trip count) and bytes sent under ring costs.
    comps, entry = computations(hlo_text)
    runs = executions(comps, entry) if entry else {}
    rows = []
    for comp, lines in comps.items() if comps else [("", hlo_text.splitlines())]:
        for line in lines:
            m = _OP_RE.search(line)
            if not m:
                continue
            op, types = m.group("op"), _SHAPE_RE.findall(m.group("type"))
            # Async starts return (operands, results); an all-reduce-start may return only its
            # results (a flat tuple), and on the GPU returns ((operands), results) like the rest.
            if m.group("start") and (op != "all-reduce" or m.group("type").startswith("((")):
                types = types[len(types) // 2 :]
            n = _group_size(line, num_devices)
            times = runs.get(comp, 1)
            for dtype, dims in types:
                elems = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
                nbytes = elems * DTYPE_BYTES.get(dtype, 4)
                ring = {
                    "all-reduce": 2 * (n - 1) / n,
                    "all-gather": (n - 1) / n,
                    "reduce-scatter": float(n - 1),
                    "all-to-all": (n - 1) / n,
                    "collective-permute": 1.0,
                }[op]
                sent = nbytes * ring * times if n > 1 else 0.0
                rows.append(dict(op=op, dtype=dtype, bytes=nbytes, group=n, runs=times, sent=sent))
    return rows


def bytes_summary(rows: list[dict]) -> dict:
    """Sent bytes per device, by '<op> <dtype>' and in total."""
    out: dict[str, float] = {}
    for r in rows:
        key = f"{r['op']} {r['dtype']}"
        out[key] = out.get(key, 0.0) + r["sent"]
    out["total"] = sum(r["sent"] for r in rows)
    return out


def fp8_collectives_in_stablehlo(text: str) -> dict[str, list[str]]:
    """Element types of the all_to_all / all_gather ops of a lowered (StableHLO) module."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        for op in ("all_to_all", "all_gather"):
            if f"stablehlo.{op}" in line:
                m = re.search(r":\s*\(tensor<[^>]*x(\w+)>", line)
                if m:
                    found.setdefault(op, []).append(m.group(1))
    return found
