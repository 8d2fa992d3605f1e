"""Matrix products with few rows: ``x @ w.T`` for 2 to ``FEW_ROWS`` rows, in the fastest NumPy form.

A batched decode step multiplies a few rows (one per request) by every weight matrix. The weights
dominate the memory traffic, so 8 rows should cost little more than one. Whether they do depends on
how the product is handed to BLAS, and the answer differs between OpenBLAS's kernels for the same
CPU (measured on SmolLM2's matrices, one thread; ``benchmarks/batching.py --formulations`` and
lesson 11 measure it again). Four formulations, each giving ``[rows, out]``:

    plain        x @ w.T                           NumPy's default: a general product (GEMM)
    left         (w @ x.T).T                       the weight as the big left operand
    sliced       x @ w[s].T per slice s            each slice of w (256 KiB) stays in the L2 cache
                                                   while every row passes over it
    sliced_gemv  w[s] @ x[r] per slice s, row r    matrix-vector products on a cached slice

Measured here (AMD EPYC, AVX-512, OpenBLAS 0.3.31, one thread, a shared machine at load ~3; all
products of a SmolLM2 decode step, best of 4, ms; one row: ~17-20 ms either kernel; sliced_gemv
with 512 KiB slices, the default 256 KiB measured 27-30 ms at 2 rows in ``benchmarks/batching.py``)::

    kernel    rows:   2      4      8     16     32     64
    SkylakeX  plain   76     77     83     99    119    148
              sliced  24     31     41    103    129    170
              left    48     53     62     65     86    128
    Haswell   plain   42     39     46     70    112    182
        sliced_gemv   29     42     66    115    203    397

So the plan (:data:`PLAN`) is per kernel, from threadpoolctl's reported architecture, decided once:
SkylakeX takes ``sliced`` up to 8 rows and ``left`` above; Haswell ``sliced_gemv`` for 2 rows and
the plain product above; a kernel not measured keeps the plain product (never slower than NumPy's
default by our choice). Every formulation gives the same sums in another order: float32 rounding
apart, the same numbers (tested against the plain product and transformers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

#: Products with 2..FEW_ROWS rows follow :data:`PLAN`; more rows (prefill) take the plain product.
FEW_ROWS = 64
#: Bytes of weight rows per slice in ``sliced`` and ``sliced_gemv``: a slice stays in the L2 cache
#: (2 MiB per core here) while every row uses it.
SLICE_BYTES = 256 * 1024


def plain(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T``: ``x`` ``[rows, in]``, ``w`` ``[out, in]`` -> ``[rows, out]`` (one GEMM, or a GEMV for one row)."""
    return x @ w.T


def left(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``(w @ x.T).T`` as a C-contiguous ``[rows, out]``: the weight is the left operand, the rows the
    narrow right one (OpenBLAS's SkylakeX kernel packs this shape better for 9 to 64 rows)."""
    return np.ascontiguousarray((w @ np.ascontiguousarray(x.T)).T)  # [out, rows] -> [rows, out]


def _slice_rows(w: np.ndarray) -> int:
    """Weight rows per slice of :data:`SLICE_BYTES` (at least 8)."""
    return max(8, SLICE_BYTES // (w.itemsize * w.shape[1]))


def sliced(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` one slice of ``w`` at a time (``[slice, in]``, :data:`SLICE_BYTES`), each written
    straight into its columns of ``[rows, out]``: the slice is read from memory once and reused
    from cache by every row."""
    y = np.empty((x.shape[0], w.shape[0]), dtype=np.result_type(x, w))  # [rows, out]
    step = _slice_rows(w)
    for s in range(0, w.shape[0], step):
        np.matmul(x, w[s : s + step].T, out=y[:, s : s + step])  # [rows, in] @ [in, slice]
    return y


def sliced_gemv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` as matrix-vector products on cached slices of ``w``: for each slice, every row's
    ``w[slice] @ x[r]``. Under OpenBLAS's Haswell kernel, 2 rows this way cost ~1.7x one row
    instead of the general product's ~2.5x."""
    y = np.empty((x.shape[0], w.shape[0]), dtype=np.result_type(x, w))  # [rows, out]
    step = _slice_rows(w)
    for s in range(0, w.shape[0], step):
        part = w[s : s + step]  # [slice, in]
        for r in range(x.shape[0]):
            np.matmul(part, x[r], out=y[r, s : s + step])  # [slice, in] @ [in] -> [slice]
    return y


FORMULATIONS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "plain": plain,
    "left": left,
    "sliced": sliced,
    "sliced_gemv": sliced_gemv,
}
#: BLAS kernel (threadpoolctl's ``architecture``) -> ((up to this many rows, formulation), ...);
#: rows beyond the last entry, and kernels not listed, take ``plain``. Measured: module docstring.
PLAN: dict[str, tuple[tuple[int, str], ...]] = {
    "SkylakeX": ((8, "sliced"), (FEW_ROWS, "left")),
    "Haswell": ((2, "sliced_gemv"),),
}


@functools.cache
def blas_kernel() -> str:
    """The BLAS kernel NumPy's OpenBLAS runs (``"SkylakeX"``, ``"Haswell"``, ...), or ``""`` when
    threadpoolctl does not report one (another BLAS). Fixed when NumPy loads: asked once."""
    from threadpoolctl import threadpool_info  # a dependency of minillm; imported on first use only

    for lib in threadpool_info():
        if lib.get("user_api") == "blas":
            return str(lib.get("architecture") or "")
    return ""


def formulation(rows: int, kernel: str | None = None) -> str:
    """The formulation :func:`few_rows_product` uses for ``rows`` rows under ``kernel`` (default:
    this process's, :func:`blas_kernel`). One row is always ``plain``: a matrix-vector product."""
    if rows < 2:
        return "plain"
    for up_to, name in PLAN.get(blas_kernel() if kernel is None else kernel, ()):
        if rows <= up_to:
            return name
    return "plain"


def few_rows_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` (``x`` ``[rows, in]``, ``w`` ``[out, in]`` -> ``[rows, out]``, float32) in the
    formulation :data:`PLAN` names for this BLAS kernel and row count. The same numbers as the plain
    product up to float32 rounding (the sums run in another order)."""
    return FORMULATIONS[formulation(x.shape[0])](x, w)
