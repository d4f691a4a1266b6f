"""cuBLASLt's scaled FP8 GEMMs on Hopper (rowwise, and 1 x 128 / 128 x 128 blocks), called from XLA.

XLA lowers an FP8 ``dot_general`` to cuBLASLt with one scale per tensor. cuBLASLt itself (CUDA
12.9 and later, compute capability 9.0) also applies a vector of scales per operand
(``OUTER_VEC_32F``: one per row of a and one per row of b, the rowwise recipe) and
DeepSeek-V3's block scales (``VEC128_32F``: one per 1 x 128 tile along K; ``BLK128x128_32F``:
one per 128 x 128 block) inside the GEMM, promoting each 128-wide partial into its f32
accumulator. ``csrc/scaled_gemm.cc`` calls it from an XLA FFI handler.

The handler is built on first use, with the system C++ compiler, against the cuBLASLt library
JAX has already loaded and the headers beside it (the ``nvidia`` wheels' or the CUDA
toolkit's), into ``$FP8JAX_CACHE_DIR`` (default ``~/.cache/fp8jax``). Where it cannot be (no
CUDA GPU, no compiler or headers, a GPU that is not a Hopper) or ``FP8JAX_CUBLASLT=0`` is set,
``available()`` is False and ``unavailable_reason()`` says why; callers then run their Pallas
kernels. A GEMM that cuBLASLt has no algorithm for fails at run time with one error naming it.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "BLOCK",
    "BLOCKS",
    "ROWWISE",
    "SOURCE",
    "TARGET",
    "TILES",
    "WORKSPACE",
    "available",
    "block_dot",
    "block_scales",
    "require",
    "rowwise_dot",
    "scaled_mm",
    "supports",
    "unavailable_reason",
]

TARGET = "fp8jax_scaled_gemm"
SOURCE = Path(__file__).with_name("csrc") / "scaled_gemm.cc"
BLOCK = 128  # cuBLASLt's block scales: 128 elements of K per scale
WORKSPACE = 32 << 20  # bytes: cuBLASLt's recommended workspace on Hopper
ROWWISE, BLOCKS, TILES = 0, 1, 2  # the handler's scale kinds (csrc/scaled_gemm.cc)
_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_OUT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_HEADERS = ("cublasLt.h", "cuda_runtime_api.h", "crt/host_defines.h")


def _loaded_library(name: str) -> str | None:
    """The path of a shared library this process has mapped, e.g. JAX's cuBLASLt."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # pragma: no cover - not Linux
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if f"/{name}" in line}
    return min(paths) if paths else None


def _search_roots() -> list[Path]:
    """Where CUDA headers and libraries may live: the CUDA toolkit and the ``nvidia`` wheels."""
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    roots = [Path(r) for r in roots if r]
    for site in sys.path:
        roots += [Path(p) for p in sorted(glob.glob(os.path.join(site, "nvidia", "*")))]
    return [r for r in roots if r.is_dir()]


def _find_cublaslt() -> str | None:
    lib = _loaded_library("libcublasLt.so")
    if lib:
        return lib
    for root in _search_roots():
        for sub in ("lib", "lib64"):
            hits = sorted(glob.glob(str(root / sub / "libcublasLt.so*")))
            if hits:
                return hits[-1]
    return None


def _include_dirs(lib: str) -> list[str]:
    """Directories holding each of ``_HEADERS``: the CUDA toolkit's first, then the wheels'."""
    candidates = [r / "include" for r in _search_roots()] + [Path(lib).parent.parent / "include"]
    dirs: list[str] = []
    for header in _HEADERS:
        hit = next((str(d) for d in candidates if (d / header).is_file()), None)
        if hit is None:
            raise FileNotFoundError(f"no {header} found (set CUDA_HOME to a CUDA 12.9+ toolkit)")
        if hit not in dirs:
            dirs.append(hit)
    return dirs


def _cache_dir() -> Path:
    return Path(os.environ.get("FP8JAX_CACHE_DIR", Path.home() / ".cache" / "fp8jax"))


def _build(lib: str) -> Path:
    """Compile ``SOURCE`` against ``lib`` (cached by source, flags and JAX version)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise FileNotFoundError("no C++ compiler (set CXX)")
    includes = [jax.ffi.include_dir(), *_include_dirs(lib)]
    flags = ["-std=c++17", "-O2", "-fPIC", "-shared", "-w", *(f"-I{d}" for d in includes)]
    link = [lib, f"-Wl,-rpath,{Path(lib).parent}"]
    key = hashlib.sha256(
        SOURCE.read_bytes() + repr((cxx, flags, link, jax.__version__)).encode()
    ).hexdigest()[:16]
    out = _cache_dir() / f"scaled_gemm-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        run = subprocess.run(
            [cxx, *flags, str(SOURCE), "-o", tmp, *link], capture_output=True, text=True
        )
        if run.returncode:
            raise RuntimeError(f"{cxx} failed: {run.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build or reader sees one whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _load() -> str | None:
    """Build and register the handler; None on success, else why it is not available."""
    if os.environ.get("FP8JAX_CUBLASLT", "1") == "0":
        return "disabled by FP8JAX_CUBLASLT=0"
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        return "no CUDA GPU"
    cc = str(getattr(gpus[0], "compute_capability", ""))
    if not cc.startswith("9."):
        return f"its scale modes are Hopper's (compute capability 9.x), this GPU is {cc or '?'}"
    lib = _find_cublaslt()
    if lib is None:
        return "libcublasLt not found"
    try:
        handler = ctypes.CDLL(str(_build(lib))).Fp8jaxScaledGemm
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="CUDA")
    except (OSError, RuntimeError, FileNotFoundError, AttributeError) as e:
        return f"build failed: {e}"
    return None


def require() -> None:
    """Build and register the handler, or raise one error saying why it cannot run here."""
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"fp8jax.ops.cublaslt: unavailable here: {reason}")


def available() -> bool:
    """Whether cuBLASLt's scaled GEMMs can run here (builds the handler on first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False; None when it is True."""
    return _load()


def supports(m: int, n: int, k: int, a_dtype, b_dtype, out_dtype) -> bool:
    """Whether a GEMM's shape and dtypes fit cuBLASLt's FP8 kernels: one FP8 operand at least in
    E4M3, the other FP8, the output bf16/f16/f32, and every dimension a multiple of 16 (each
    operand's rows and the output's start 16-byte aligned)."""
    dtypes = jnp.dtype(a_dtype), jnp.dtype(b_dtype)
    fp8 = all(d in _FP8 for d in dtypes) and jnp.dtype(jnp.float8_e4m3fn) in dtypes
    return fp8 and jnp.dtype(out_dtype) in _OUT and all(d > 0 and d % 16 == 0 for d in (m, n, k))


def scaled_mm(a_MxK, b_NxK, a_scale, b_scale, kind: int, out_dtype, fast_accum: bool = False):
    """``y`` [M, N] = a . b^T with cuBLASLt applying the scales (layouts by ``kind``:
    csrc/scaled_gemm.cc). The raw call: ``rowwise_dot`` and ``block_dot`` lay the scales out."""
    require()
    m, n = a_MxK.shape[0], b_NxK.shape[0]
    call = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct((m, n), out_dtype),
            jax.ShapeDtypeStruct((WORKSPACE,), jnp.uint8),
        ),
        vmap_method="sequential",  # vmapped replicas: one GEMM per batch element, in a loop
    )
    y, _ = call(
        a_MxK,
        b_NxK,
        jnp.asarray(a_scale, jnp.float32),
        jnp.asarray(b_scale, jnp.float32),
        kind=np.int32(kind),
        fast_accum=bool(fast_accum),
    )
    return y


def rowwise_dot(a_MxK, a_inv_M, b_NxK, b_inv_N, out_dtype, fast_accum: bool = True):
    """``y[i, j] = a_inv[i] * b_inv[j] * (a . b^T)[i, j]``: one multiplier per row of a and of b,
    applied in the GEMM's f32 epilogue."""
    return scaled_mm(a_MxK, b_NxK, a_inv_M, b_inv_N, ROWWISE, out_dtype, fast_accum)


def block_scales(a_inv_MxT, b_inv, blocks: bool) -> tuple[jax.Array, jax.Array]:
    """The block-scaled GEMM's multipliers in cuBLASLt's layouts: a's [T, M] (a row of M per
    tile of K), b's [Nb, T rounded up to 4] (``blocks``: 128 x 128) or [T, N] (1 x 128 rows)."""
    a_s = jnp.asarray(a_inv_MxT, jnp.float32).T
    b_inv = jnp.asarray(b_inv, jnp.float32)
    if not blocks:
        return a_s, b_inv.T
    t = b_inv.shape[1]
    return a_s, jnp.pad(b_inv, ((0, 0), (0, 4 * math.ceil(t / 4) - t)))


def block_dot(a_MxK, a_inv_MxT, b_NxK, b_inv, blocks: bool, out_dtype):
    """``block_gemm.block_scaled_dot``'s contract (block 128) on cuBLASLt: ``a_inv_MxT`` [M, T],
    ``b_inv`` [ceil(N / 128), T] (``blocks``) or [N, T]."""
    a_s, b_s = block_scales(a_inv_MxT, b_inv, blocks)
    return scaled_mm(a_MxK, b_NxK, a_s, b_s, BLOCKS if blocks else TILES, out_dtype)
