"""``minillm.load(threads=)`` (minillm/runtime/loading.py) sets the BLAS threads, shows them in the trace's load
section and refuses anything but a whole number of at least one.
"""

from __future__ import annotations

import pytest

import minillm
from minillm.errors import InvalidRequestError


def _blas_threads() -> set[int]:
    from threadpoolctl import threadpool_info

    return {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}


def test_threads_on_load_sets_the_blas_threads_and_the_trace_shows_them(folder):
    from threadpoolctl import threadpool_limits

    before = _blas_threads()
    tracer = minillm.Tracer()
    try:
        model = minillm.load(folder, progress=False, warmup=False, threads=1, tracer=tracer)
        assert _blas_threads() == {1} and model.threads == 1
        assert all(line.endswith(", 1 thread") for line in tracer.events[0].data["blas"])
    finally:
        threadpool_limits(limits=max(before), user_api="blas")
    assert _blas_threads() == before


@pytest.mark.parametrize("threads", [0, -2, 1.5, True])
def test_threads_must_be_a_whole_number_of_at_least_one(folder, threads):
    with pytest.raises(InvalidRequestError, match=rf"threads must be a whole number >= 1, got {threads!r}; "
                                                  r"pass None to keep the BLAS default \(all cores\)\."):
        minillm.load(folder, progress=False, warmup=False, threads=threads)
