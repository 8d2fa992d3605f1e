"""The engine room's few-rows products (minillm/kernels/products.py) compute the product, and the plan picks them.

Every formulation against NumPy's float64 product (a reference computed outside minillm's code paths),
for the model's own shapes and 1 to 64 rows; the plan per BLAS kernel and thread count against the
table written by hand from products.py's rules; ``TunedKernels.linear`` takes the plan only inside a
batched pass; the prefill's ``left`` form only where ``PREFILL_LEFT`` names it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from minillm.kernels import products
from minillm.kernels.tuned import TUNED
from minillm.model.held import Float32Matrix, Int8Matrix, StackedMatrix

# SmolLM2-135M's matrices ([out, in]): q|k|v fused, o, gate|up fused, down, and a slice of the LM
# head's shape (rows not a multiple of a slice, so the last slice is short).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (5000, 576)]


@pytest.mark.parametrize("name", sorted(products.FORMULATIONS))
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 33, 64])
def test_every_formulation_is_the_product(name, rows):
    rng = np.random.default_rng(rows)
    for out_dim, in_dim in SHAPES:
        w = rng.standard_normal((out_dim, in_dim), dtype=np.float32) / np.float32(np.sqrt(in_dim))
        x = rng.standard_normal((rows, in_dim), dtype=np.float32)
        got = products.FORMULATIONS[name](x, w)
        want = x.astype(np.float64) @ w.astype(np.float64).T  # the reference: float64, NumPy
        assert got.shape == (rows, out_dim) and got.dtype == np.float32
        # one memory order or the other (``left`` gives its [out, rows] product's transposed view)
        assert got.flags.c_contiguous or (name == "left" and got.flags.f_contiguous)
        # float32 sums of 576..1536 terms of size ~1: rounding well under 1e-4
        assert np.abs(got - want).max() < 1e-4, (name, rows, out_dim, in_dim)


def test_the_plan_per_kernel_and_threads_is_the_measured_table():
    # Written by hand from the table in products.py's docstring (SmolLM2's products, 1 and 2 threads).
    expected = {
        ("SkylakeX", 1): {1: "plain", 2: "sliced", 8: "sliced", 9: "left", 32: "left", 64: "left", 65: "plain"},
        ("SkylakeX", 2): {1: "plain", 2: "sliced", 4: "sliced", 5: "left", 8: "left", 64: "left", 65: "plain"},
        ("SkylakeX", 8): {4: "sliced", 5: "left"},  # more threads than measured: the most measured
        ("Haswell", 1): {1: "plain", 2: "sliced_gemv", 3: "sliced_gemv", 4: "left", 64: "left", 65: "plain"},
        ("Haswell", 2): {2: "sliced_gemv", 3: "plain", 8: "plain", 64: "plain"},
        ("Zen", 1): {2: "plain", 8: "plain"},  # a kernel never measured keeps NumPy's own product
        ("", 2): {2: "plain"},  # no OpenBLAS (threadpoolctl reports no architecture)
    }
    for (kernel, threads), by_rows in expected.items():
        got = {rows: products.formulation(rows, kernel, threads) for rows in by_rows}
        assert got == by_rows, (kernel, threads)
    # This process's kernel and thread count are the ones threadpoolctl reports; the thread count
    # is read at each product, so threadpool_limits changes the plan.
    from threadpoolctl import threadpool_info, threadpool_limits

    blas = [lib for lib in threadpool_info() if lib["user_api"] == "blas"]
    assert products.blas_kernel() == str(blas[0].get("architecture") or "")
    for threads in (1, 2):
        with threadpool_limits(threads, "blas"):
            assert products.blas_threads() == threads
            assert products.formulation(8) == products.formulation(8, products.blas_kernel(), threads)


def test_linear_takes_the_plan_only_inside_a_batched_pass(monkeypatch):
    seen = []
    monkeypatch.setattr(products, "few_rows_product", lambda x, w: seen.append(x.shape[0]) or x @ w.T)
    x, w = np.ones((8, 4), np.float32), Float32Matrix(np.ones((3, 4), np.float32))
    no_rows = SimpleNamespace(layer_types=[], inv_freq={})  # position tables: a pass of products only
    one_sequence = TUNED.begin(None, no_rows, [])
    batch = TUNED.begin(None, no_rows, [], batch=True)
    one_sequence.linear(x, w)  # one sequence's forward: the plain product, as lesson 1 measured
    TUNED.linear(x, w)  # the kernels' own product: one sequence's
    batch.linear(x, w)  # 8 rows in a batched pass: the plan
    batch.linear(x[:1], w)  # one row: a matrix-vector product either way
    batch.linear(np.ones((65, 4), np.float32), w)  # more than FEW_ROWS: the plain product
    batch.linear(x, StackedMatrix([w, w]))  # a memory-mapped projection's parts: each by the plan
    batch.linear(x, Int8Matrix(w.dense))  # a compact format: its own chunked product
    assert seen == [8, 8, 8]


def test_prefill_takes_left_for_gate_up_under_skylakex_only():
    # Written by hand from PREFILL_LEFT's measurements: SkylakeX's prefill gate_up; nothing else.
    form = products.prefill_formulation
    assert form("gate_up", 512, "SkylakeX") == form("gate_up", 65, "SkylakeX") == "left"
    assert form("gate_up", 64, "SkylakeX") == "plain"  # few rows: linear's own plan
    assert {form(name, 512, "SkylakeX") for name in ("qkv", "o", "down", "up")} == {"plain"}
    assert {form("gate_up", 512, kernel) for kernel in ("Haswell", "Zen", "")} == {"plain"}
