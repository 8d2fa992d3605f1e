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

Which form wins, at how many rows, is measured by ``python -m benchmarks.batching`` (the products
of a decode step alone, in every formulation, for this BLAS kernel and thread count; the README's
batching section keeps its results) and by lesson 11.

So the plan (:data:`PLAN`) is per kernel (threadpoolctl's reported architecture, asked once) and
per BLAS thread count (asked at each product: ``threadpool_limits`` may change it): SkylakeX takes
``sliced`` up to 8 rows with one thread, up to 4 with two (a second thread speeds the general
product more than the cached slices), and ``left`` above; Haswell ``sliced_gemv`` up to 3 rows and
``left`` above with one thread, ``sliced_gemv`` up to 2 rows and the plain product above with two;
a kernel not measured keeps the plain product (never slower than NumPy's default by our choice).
The same kernel runs differently on another CPU: the Haswell rows for one thread were measured
again on a CPU with a smaller last-level cache, where ``left`` beat the plain product from 4 rows
on (on the first machine measured they had tied). Every formulation gives the same sums in another
order: float32 rounding apart, the same numbers (tested against the plain product and transformers).
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
#: Weight rows per slice in ``left`` for tall matrices (the LM head): a ``[4096, 64]`` float32 result is 1 MiB.
LEFT_SLICE_ROWS = 4096


def plain(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T``: ``x`` ``[rows, in]``, ``w`` ``[out, in]`` -> ``[rows, out]`` (one GEMM, or a GEMV for one row)."""
    return x @ w.T


def left(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``(w @ x.T).T``: the weight is the left operand, the rows the narrow right one (OpenBLAS's
    SkylakeX kernel packs this shape better for 9 to 64 rows). Returns ``[rows, out]`` as the
    transposed view of the ``[out, rows]`` product (column-major: no copy; NumPy's elementwise
    operations take either order, and the next projection's ``x.T`` is then already contiguous,
    which shortens a 32-row decode step). A tall matrix (the LM head) is done
    :data:`LEFT_SLICE_ROWS` weight rows at a time into a C-ordered result, each slice turned while
    it is in cache (sampling reads logits row by row; the whole ``[49152, 32]`` turned at once
    reads the 6 MB result once per row). Both gains are measured by ``python -m benchmarks.batching``."""
    out_dim, rows = w.shape[0], x.shape[0]
    # [in, rows]: contiguous for a few rows (free when x is itself a transposed product); a
    # prefill's many rows are read as the transposed operand they are (copying them slows a prefill)
    x_t = np.ascontiguousarray(x.T) if rows <= FEW_ROWS else x.T
    if out_dim <= LEFT_SLICE_ROWS:
        return (w @ x_t).T  # [out, rows] -> a [rows, out] view
    y = np.empty((rows, out_dim), dtype=np.result_type(x, w))  # [rows, out]
    part = np.empty((LEFT_SLICE_ROWS, rows), dtype=y.dtype)  # [slice, rows], reused
    for s in range(0, out_dim, LEFT_SLICE_ROWS):
        n = min(LEFT_SLICE_ROWS, out_dim - s)
        np.matmul(w[s : s + n], x_t, out=part[:n])  # [slice, in] @ [in, rows]
        y[:, s : s + n] = part[:n].T
    return y


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
#: BLAS kernel (threadpoolctl's ``architecture``) -> BLAS threads -> ((up to this many rows,
#: formulation), ...); rows beyond the last entry, and kernels not listed, take ``plain``; more
#: threads than listed take the entry of the most threads listed. Measured: module docstring.
PLAN: dict[str, dict[int, tuple[tuple[int, str], ...]]] = {
    "SkylakeX": {1: ((8, "sliced"), (FEW_ROWS, "left")), 2: ((4, "sliced"), (FEW_ROWS, "left"))},
    "Haswell": {1: ((3, "sliced_gemv"), (FEW_ROWS, "left")), 2: ((2, "sliced_gemv"),)},
}


#: Prefill (more than :data:`FEW_ROWS` rows): the projections that take ``left`` under a kernel,
#: by name (the ``projection`` ``TunedKernels.linear`` is told). Under SkylakeX ``W_gate_up @ x.T`` (``[3072, 576] @
#: [576, 512]``) runs faster than ``x @ W.T``, and its column-major result costs nothing
#: downstream: SiLU and the product with ``up`` are elementwise on it, and ``down`` reads it as a
#: transposed operand; a whole prefill gains, the same numbers to the bit. ``qkv`` and ``o`` gain as
#: products but lose it again in the head reshapes and the residual add; under Haswell no projection
#: gains. Measured by ``python -m benchmarks.batching`` (its prefill against the GEMM ceiling; the
#: README's figures).
PREFILL_LEFT: dict[str, frozenset[str]] = {"SkylakeX": frozenset({"gate_up"})}


def prefill_formulation(name: str, rows: int, kernel: str | None = None) -> str:
    """The formulation ``TunedKernels.linear`` uses for projection ``name`` (``"qkv"``,
    ``"gate_up"``, ...) over ``rows`` rows when they are more than :data:`FEW_ROWS` (a prefill):
    ``"left"`` where :data:`PREFILL_LEFT` lists it for ``kernel`` (default: this process's),
    else ``"plain"``."""
    if rows <= FEW_ROWS:
        return "plain"
    return "left" if name in PREFILL_LEFT.get(blas_kernel() if kernel is None else kernel, ()) else "plain"


@functools.cache
def _blas():
    """threadpoolctl's controller of NumPy's BLAS, or None when it reports none (another BLAS)."""
    from threadpoolctl import ThreadpoolController  # a dependency of minillm; imported on first use only

    found = ThreadpoolController().select(user_api="blas").lib_controllers
    return found[0] if found else None


def blas_kernel() -> str:
    """The BLAS kernel NumPy's OpenBLAS runs (``"SkylakeX"``, ``"Haswell"``, ...), or ``""`` when
    threadpoolctl does not report one (another BLAS). Fixed when NumPy loads."""
    blas = _blas()
    return str(getattr(blas, "architecture", "") or "") if blas is not None else ""


def blas_threads() -> int:
    """BLAS threads now (``threadpool_limits`` changes them; a C call, well under a microsecond)."""
    blas = _blas()
    return int(blas.get_num_threads()) if blas is not None else 1


def plan(kernel: str | None = None, threads: int | None = None) -> tuple[tuple[int, str], ...]:
    """:data:`PLAN`'s entry for ``kernel`` and ``threads`` (default: this process's, now)."""
    by_threads = PLAN.get(blas_kernel() if kernel is None else kernel, {})
    threads = blas_threads() if threads is None else threads
    listed = [t for t in by_threads if t <= threads] or sorted(by_threads)[:1]
    return by_threads[max(listed)] if listed else ()


def formulation(rows: int, kernel: str | None = None, threads: int | None = None) -> str:
    """The formulation :func:`few_rows_product` uses for ``rows`` rows under ``kernel`` with
    ``threads`` BLAS threads (default: this process's, now). One row is always ``plain``: a
    matrix-vector product."""
    if rows < 2:
        return "plain"
    for up_to, name in plan(kernel, threads):
        if rows <= up_to:
            return name
    return "plain"


def few_rows_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` (``x`` ``[rows, in]``, ``w`` ``[out, in]`` -> ``[rows, out]``, float32) in the
    formulation :data:`PLAN` names for this BLAS kernel, thread count and row count. The same numbers as the plain
    product up to float32 rounding (the sums run in another order)."""
    return FORMULATIONS[formulation(x.shape[0])](x, w)
