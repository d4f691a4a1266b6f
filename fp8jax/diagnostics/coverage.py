"""FP8 coverage of a jitted function: which of its matmuls run in FP8.

``coverage_report(train_step, state, batch)`` lowers the function and lists every
``stablehlo.dot_general`` with its operand element types and shapes. On GPU it also compiles
and counts the GEMM kernels XLA picked: ``__cublas$lt$matmul$f8`` is an FP8 GEMM, anything
else (``__cublas$lt$matmul``, ``__cublas$gemm``, Triton GEMM fusions) is not. The StableHLO view
says what the program asks for; the compiled view says what XLA delivered (it silently
upcasts E5M2 x E5M2 and layouts cuBLASLt cannot take).

The expert layers' grouped GEMMs (``ops.grouped``) are listed with the rest: a ``chlo.ragged_dot``
(GPU and TPU lowerings; its decomposition is not counted again) or, on CPU, the dense
``dot_general`` ``ragged_dot`` expands to; ``DotEntry.grouped`` marks them, under their scope.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import jax

from fp8jax.ops import cublaslt, grouped, grouped_mgpu, scaling

__all__ = [
    "BLOCK_GEMM",
    "CUBLAS_FP8",
    "FP8_KERNELS",
    "GROUPED_FP8",
    "FP8_TYPES",
    "MOSAIC",
    "RAGGED_DOT",
    "SCALED_GEMM",
    "TRITON",
    "CoverageReport",
    "DotEntry",
    "coverage_report",
    "gemm_counts",
    "parse_stablehlo",
]

# Element types XLA treats as FP8 (the first two are the ones fp8jax emits).
FP8_TYPES = (
    "f8E4M3FN",
    "f8E5M2",
    "f8E4M3",
    "f8E4M3FNUZ",
    "f8E5M2FNUZ",
    "f8E4M3B11FNUZ",
    "f8E3M4",
)
CUBLAS_FP8 = "__cublas$lt$matmul$f8"
BLOCK_GEMM = "fp8_block_scaled_dot"  # fp8jax's block-scaled FP8 GEMM (ops.block_gemm, Pallas)
TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "mosaic_gpu"  # Pallas' Mosaic GPU kernels' custom calls (mosaic_gpu, mosaic_gpu_v2)
SCALED_GEMM = cublaslt.TARGET  # cuBLASLt's rowwise- and block-scaled FP8 GEMMs (ops.cublaslt)
GROUPED_FP8 = grouped_mgpu.KERNEL_NAME  # the expert layers' FP8 grouped GEMMs (Mosaic GPU)
# Compiled GEMM kernels that run in FP8.
FP8_KERNELS = (CUBLAS_FP8, BLOCK_GEMM, SCALED_GEMM, GROUPED_FP8)
RAGGED_DOT = "ragged_dot"  # a grouped GEMM's chlo.ragged_dot (a composite op on GPU)
# The named scope ops.dot opens around each FP8 matmul: 'fp8_<recipe>', a name in
# scaling.RECIPES (in the backward pass inside transpose(jvp(...))).
_RECIPE = re.compile(r"(?:^|[/(])fp8_(\w+?)(?=[/)]|$)")
_OPERANDS = re.compile(r":\s*\(((?:tensor<[^>]*>,?\s*)+)\)\s*->\s*\(?(tensor<[^>]*>)")

_FUNC = re.compile(r"func\.func\s+(?:public\s+|private\s+)?@\"?([^\s(\"]+)")
_CALL = re.compile(r"\bcall\s+@\"?([^\s(\"]+)")
_DOT = re.compile(r"stablehlo\.dot(?:_general)?(?!\w)")
_RAGGED = re.compile(r'(?:"chlo\.ragged_dot"|\bchlo\.ragged_dot\b)')
_DECOMPOSITION = re.compile(r"decomposition\s*=\s*@\"?([^\s,}\"]+)")
# A composite's ragged_dot_dimension_numbers: lhs, rhs batching; lhs, rhs contracting; lhs
# ragged; rhs group dims, each a dense<...> constant.
_RAGGED_DIMS = re.compile(r"ragged_dot_dimension_numbers\s*=\s*\[(.*?)\]\s*[,}]")
_DENSE = re.compile(r"dense<([^>]*)>")
# The chlo op's own attribute syntax: #chlo.ragged_dot<lhs_ragged_dimensions = [0], ...>
_RAGGED_GENERIC = re.compile(
    r"(lhs|rhs)_(batching|contracting|ragged|group)_dimensions\s*=\s*\[([\d,\s]*)\]"
)
_SIG = re.compile(r":\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")
_DIMS = re.compile(r"(contracting_dims|batching_dims)\s*=\s*\[([\d,\s]*)\]\s*x\s*\[([\d,\s]*)\]")
# Generic (quoted-op) syntax: #stablehlo.dot<lhs_contracting_dimensions = [1], ...>
_GENERIC = re.compile(r"(lhs|rhs)_(batching|contracting)_dimensions\s*=\s*\[([\d,\s]*)\]")
_LOC_USE = re.compile(r"loc\((#loc\d*)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d*)\s*=\s*loc\((.*)\)\s*$")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind"\s*:\s*"(__triton_gemm|__cudnn\$fusion)"')


def _tensor(t: str) -> tuple[str, tuple[int | None, ...]]:
    """'tensor<4x8xf8E4M3FN>' -> ('f8E4M3FN', (4, 8)); dynamic dims become None."""
    inner = t[len("tensor<") : -1].split(",")[0]  # drop an encoding attribute if present
    *dims, dtype = inner.split("x")
    return dtype, tuple(None if d == "?" else int(d) for d in dims)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(d) for d in s.split(",") if d.strip())


@dataclasses.dataclass(frozen=True)
class DotEntry:
    """One ``dot_general`` in the lowered program."""

    lhs_dtype: str
    rhs_dtype: str
    out_dtype: str
    lhs_shape: tuple[int | None, ...]
    rhs_shape: tuple[int | None, ...]
    out_shape: tuple[int | None, ...]
    contracting: tuple[tuple[int, ...], tuple[int, ...]]
    batching: tuple[tuple[int, ...], tuple[int, ...]]
    function: str  # the StableHLO function holding it ('main' or a private helper)
    count: int  # how many times the program reaches it (a loop body counts once)
    name: str  # JAX name stack, e.g. 'jit(step)/transpose(jvp(Dense_0))/Fp8DotGeneral_0'
    kernel: str = "dot_general"  # 'dot_general' (XLA picks), BLOCK_GEMM, SCALED_GEMM, RAGGED_DOT
    ragged: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # a ragged dot's lhs ragged and
    # rhs group dims (its group axis leads the output when the ragged dim is contracted)

    @property
    def grouped(self) -> bool:
        """A grouped (expert) GEMM: a ragged dot, or a dot under ``ops.grouped``'s scope."""
        return bool(self.ragged[0]) or grouped.SCOPE in self.name

    @property
    def recipe(self) -> str:
        """The FP8 recipe of the matmul this dot belongs to ('' outside fp8jax's FP8 matmuls)."""
        names = (m.group(1) for m in _RECIPE.finditer(self.name))
        return next((n for n in names if n in scaling.RECIPES), "")

    @property
    def is_fp8(self) -> bool:
        """Both operands FP8: the only case cuBLASLt runs as an FP8 GEMM."""
        return self.lhs_dtype in FP8_TYPES and self.rhs_dtype in FP8_TYPES

    @property
    def fp8(self) -> bool:
        """Alias of ``is_fp8``."""
        return self.is_fp8

    @property
    def flops(self) -> int:
        """2 * output elements * contracted size, per execution (0 if a dim is dynamic)."""
        k_dims = [self.lhs_shape[d] for d in self.contracting[0]]
        out = self.out_shape
        if set(self.ragged[0]) & set(self.contracting[0]):
            out = out[1:]  # [G, ...]: each contracted row enters one group's product only
        sizes = [*out, *k_dims]
        return 0 if None in sizes else 2 * math.prod(sizes)


@dataclasses.dataclass(frozen=True)
class CoverageReport:
    """Every dot_general of a lowered function and, on GPU, the GEMM kernels it compiled to."""

    entries: tuple[DotEntry, ...]
    gemm_counts: dict[str, int] | None  # compiled GEMM kernel -> count; None if not compiled

    @property
    def num_total(self) -> int:
        """Dot_generals the program executes (loop bodies counted once)."""
        return sum(e.count for e in self.entries)

    @property
    def num_fp8(self) -> int:
        """Dot_generals with two FP8 operands."""
        return sum(e.count for e in self.entries if e.is_fp8)

    @property
    def fp8_share(self) -> float:
        """``num_fp8 / num_total`` (0.0 for a program without dots)."""
        return self.num_fp8 / self.num_total if self.num_total else 0.0

    @property
    def fp8_flop_share(self) -> float:
        """Share of dot FLOPs that run with FP8 operands."""
        total = sum(e.flops * e.count for e in self.entries)
        fp8 = sum(e.flops * e.count for e in self.entries if e.is_fp8)
        return fp8 / total if total else 0.0

    @property
    def grouped(self) -> tuple[DotEntry, ...]:
        """The grouped (expert) GEMMs, with their operand formats in ``lhs_dtype``/``rhs_dtype``."""
        return tuple(e for e in self.entries if e.grouped)

    @property
    def num_fp8_gemms(self) -> int | None:
        """Compiled FP8 GEMMs: ``__cublas$lt$matmul$f8`` calls, fp8jax's block-scaled and
        grouped GEMM kernels (None when not compiled for GPU)."""
        if self.gemm_counts is None:
            return None
        return sum(self.gemm_counts.get(k, 0) for k in FP8_KERNELS)

    @property
    def num_other_gemms(self) -> int | None:
        """Compiled GEMMs that are not FP8 (cuBLAS, cuBLASLt, Triton, cuDNN)."""
        if self.gemm_counts is None:
            return None
        return sum(n for k, n in self.gemm_counts.items() if k not in FP8_KERNELS)

    def __str__(self) -> str:
        def fmt(dtype, shape):
            return f"{dtype}[{','.join('?' if d is None else str(d) for d in shape)}]"

        lines = [
            f"FP8 coverage: {self.num_fp8}/{self.num_total} dot_generals in FP8 "
            f"({100 * self.fp8_share:.1f}%), {100 * self.fp8_flop_share:.1f}% of dot FLOPs"
            + (
                f"; grouped (expert) GEMMs: {sum(e.is_fp8 for e in self.grouped)}/"
                f"{len(self.grouped)} in FP8"
                if self.grouped
                else ""
            ),
            f"{'#':>3} {'n':>3} {'fp8':<4} {'recipe':<8} {'kernel':<20} {'lhs':<22} "
            f"{'rhs':<22} {'out':<18} name",
        ]
        for i, e in enumerate(self.entries):
            name = e.name if len(e.name) <= 70 else "..." + e.name[-67:]
            # A grouped GEMM lowered as a dense dot (CPU's ragged_dot) says so.
            kernel = f"dense {RAGGED_DOT}" if e.grouped and e.kernel != RAGGED_DOT else e.kernel
            lines.append(
                f"{i:>3} {e.count:>3} {'yes' if e.is_fp8 else 'NO':<4} {e.recipe or '-':<8} "
                f"{kernel:<20} {fmt(e.lhs_dtype, e.lhs_shape):<22} "
                f"{fmt(e.rhs_dtype, e.rhs_shape):<22} {fmt(e.out_dtype, e.out_shape):<18} {name}"
            )
        if self.gemm_counts is not None:
            kernels = ", ".join(f"{k} x{n}" for k, n in sorted(self.gemm_counts.items()))
            lines.append(
                f"compiled GEMMs: {self.num_fp8_gemms} FP8, {self.num_other_gemms} other"
                f" ({kernels or 'none'})"
            )
        return "\n".join(lines)


def _locations(text: str) -> dict[str, str]:
    """Map '#locN' to its name-stack string, following nested location references."""
    raw = {}
    for line in text.splitlines():
        m = _LOC_DEF.match(line)
        if m:
            raw[m.group(1)] = m.group(2)

    def resolve(ref: str, depth: int = 0) -> str:
        body = raw.get(ref, "")
        named = re.match(r'"([^"]*)"\s*\(', body)  # loc("name"(#child)): a name-stack entry
        if named:
            return named.group(1)
        if depth < 8:  # callsite(...)/fused[...]: take the first child that resolves to a name
            for child in re.findall(r"#loc\d*", body):
                name = resolve(child, depth + 1)
                if name:
                    return name
        return ""

    return {ref: resolve(ref) for ref in raw}


def _loc_name(line: str, locs: dict[str, str]) -> str:
    """The name stack of the op on ``line`` ('' without a location)."""
    loc = _LOC_USE.search(line)
    return locs.get(loc.group(1), "") if loc else ""


def _kernel_call(line: str, locs: dict[str, str]) -> str | None:
    """The FP8 GEMM kernel a StableHLO line calls, if any: BLOCK_GEMM (the Triton kernel names
    itself, the Mosaic kernel's call runs under a scope of its name) or SCALED_GEMM."""
    if f"@{SCALED_GEMM}(" in line:
        return SCALED_GEMM
    if TRITON in line:
        return BLOCK_GEMM if f'name = "{BLOCK_GEMM}"' in line else None
    return BLOCK_GEMM if f"@{MOSAIC}" in line and BLOCK_GEMM in _loc_name(line, locs) else None


def parse_stablehlo(text: str) -> tuple[DotEntry, ...]:
    """Every dot in a StableHLO module, with how many times the call graph reaches it."""
    locs = _locations(text)
    dots: list[tuple[str, str]] = []  # (function, line)
    calls: Counter[tuple[str, str]] = Counter()  # (caller, callee) -> call sites
    call_site: dict[str, tuple[str, str]] = {}  # callee -> (its first caller, that call's name)
    # A composite's decomposition (chlo.ragged_dot's per-group dots) is not run beside it.
    decompositions = set(_DECOMPOSITION.findall(text))
    func = "main"
    for line in text.splitlines():
        m = _FUNC.search(line)
        if m:
            func = m.group(1)
            continue
        for callee in _CALL.findall(line):
            calls[(func, callee)] += 1
            call_site.setdefault(callee, (func, _loc_name(line, locs)))
        if func in decompositions:
            continue
        if _DOT.search(line) or _RAGGED.search(line) or _kernel_call(line, locs):
            dots.append((func, line))

    memo: dict[str, int] = {}

    def scope(f: str, depth: int = 0) -> str:
        # The name stack a function's ops run under: its (first) call site's, transitively.
        if f not in call_site or depth > 64:
            return ""
        caller, name = call_site[f]
        return joined(scope(caller, depth + 1), name)

    def joined(outer: str, name: str) -> str:
        return f"{outer}/{name}" if outer and name else outer or name

    def reach(f: str, depth: int = 0) -> int:
        # How often `f` runs per call of main: sum over its call sites of the caller's count.
        if f == "main" or depth > 64:
            return 1
        if f not in memo:
            memo[f] = sum(n * reach(c, depth + 1) for (c, g), n in calls.items() if g == f)
        return memo[f]

    entries = []
    for f, line in dots:
        name = joined(scope(f), _loc_name(line, locs))
        kernel = _kernel_call(line, locs)
        if kernel:
            entries.append(_kernel_entry(line, kernel, (f, reach(f), name)))
            continue
        if _RAGGED.search(line):
            entries.append(_ragged_entry(line, (f, reach(f), name)))
            continue
        sig = _SIG.search(line)
        if not sig:
            continue
        lhs, rhs, out = (_tensor(t) for t in sig.groups())
        dims = {"contracting": [(), ()], "batching": [(), ()]}
        for kind, a, b in _DIMS.findall(line):
            dims[kind.removesuffix("_dims")] = [_ints(a), _ints(b)]
        for side, kind, a in _GENERIC.findall(line):
            dims[kind][side == "rhs"] = _ints(a)
        if "dot_general" not in line and lhs[1] and rhs[1]:
            # Plain stablehlo.dot: contract lhs's last axis with rhs's first.
            dims["contracting"] = [(len(lhs[1]) - 1,), (0,)]
        where = (f, reach(f), name.removesuffix("/dot_general"))
        entries.append(_entry(lhs, rhs, out, (*dims["contracting"], *dims["batching"]), where))
    return tuple(entries)


def _entry(lhs, rhs, out, dims, where, kernel: str = "dot_general") -> DotEntry:
    """A ``DotEntry`` from its three ``(dtype, shape)`` tensors, ``dims`` (lhs and rhs
    contracting, then batching) and ``where``: (function, count, name)."""
    (ld, ls), (rd, rs), (od, os_), (lc, rc, lb, rb) = lhs, rhs, out, dims
    function, count, name = where
    return DotEntry(ld, rd, od, ls, rs, os_, (lc, rc), (lb, rb), function, count, name, kernel)


def _ragged_entry(line: str, where) -> DotEntry:
    """A ``chlo.ragged_dot`` (its operands lhs, rhs, group sizes) as a dot with its ragged dims."""
    operands, out = _OPERANDS.search(line).groups()
    lhs, rhs = (_tensor(t) for t in re.findall(r"tensor<[^>]*>", operands)[:2])
    dims = {k: [(), ()] for k in ("batching", "contracting", "ragged")}
    listed = _RAGGED_DIMS.search(line)
    if listed:
        values = [_ints(v.replace("[", "").replace("]", "")) for v in _DENSE.findall(listed[1])]
        if len(values) == 6:
            dims["batching"], dims["contracting"], dims["ragged"] = map(
                list, (values[0:2], values[2:4], values[4:6])
            )
    for side, kind, a in _RAGGED_GENERIC.findall(line):
        kind = "ragged" if kind == "group" else kind
        dims[kind][side == "rhs"] = _ints(a)
    entry = _entry(lhs, rhs, _tensor(out), (*dims["contracting"], *dims["batching"]), where)
    return dataclasses.replace(entry, kernel=RAGGED_DOT, ragged=tuple(dims["ragged"]))


def _kernel_entry(line: str, kernel: str, where) -> DotEntry:
    """An FP8 GEMM kernel's call as a dot: operands a [M, K] and b [N, K] (K contracted), then
    their inverse scales; its first result is the product."""
    operands, out = _OPERANDS.search(line).groups()
    a, b = (_tensor(t) for t in re.findall(r"tensor<[^>]*>", operands)[:2])
    return _entry(a, b, _tensor(out), ((1,), (1,), (), ()), where, kernel)


def gemm_counts(compiled_text: str) -> dict[str, int]:
    """Count GEMM kernels in optimized HLO text: cuBLAS custom-calls and GEMM fusions."""
    counts: Counter[str] = Counter()
    for target in _TARGET.findall(compiled_text):
        if "cublas" in target or "gemm" in target.lower() or "matmul" in target:
            counts[target] += 1
    for kind in _FUSION_KIND.findall(compiled_text):
        counts[kind] += 1
    # The block-scaled GEMM is a Triton custom call named by its kernel, or a Mosaic GPU custom
    # call whose op name carries the kernel's scope.
    n_block = sum(
        1
        for line in compiled_text.splitlines()
        if (TRITON in line or MOSAIC in line) and BLOCK_GEMM in line
    )
    if n_block:
        counts[BLOCK_GEMM] = n_block
    # The grouped GEMMs' Mosaic GPU kernels (ops.grouped_mgpu), named by their scope.
    for name in (grouped_mgpu.KERNEL_NAME, grouped_mgpu.BF16_KERNEL_NAME):
        n = sum(1 for line in compiled_text.splitlines() if MOSAIC in line and name in line)
        if n:
            counts[name] = n
    return dict(counts)


def coverage_report(fn, *args, compile: bool | None = None, **kwargs) -> CoverageReport:
    """Lower ``fn(*args, **kwargs)`` and report its FP8 dot_generals.

    ``fn`` may be a plain function, a ``jax.jit``-wrapped one (its shardings and static
    arguments are kept) or a ``jax.stages.Lowered``. ``compile`` (default: on GPU only) also
    compiles and counts the GEMM kernels; it is the one keyword not passed on to ``fn``.
    """
    if isinstance(fn, jax.stages.Lowered):
        if args or kwargs:
            raise TypeError("coverage_report: a Lowered takes no further arguments")
        lowered = fn
    else:
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        lowered = jitted.lower(*args, **kwargs)
    try:
        text = lowered.as_text(debug_info=True)  # keeps name stacks for the 'name' column
    except TypeError:  # older Lowered.as_text without debug_info
        text = lowered.as_text()
    entries = parse_stablehlo(text)
    if compile is None:
        compile = jax.default_backend() == "gpu"
    counts = gemm_counts(lowered.compile().as_text()) if compile else None
    return CoverageReport(entries=entries, gemm_counts=counts)
