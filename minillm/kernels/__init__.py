"""The engine room: the tuned formulations behind the textbook's ``Kernels`` seam.

``products.py`` (few-rows products, the transposed ``left`` form, the plan per BLAS kernel and
thread count), ``attention.py`` (prefill attention in causal chunks), ``paged_decode.py`` (a
batch's decode rows over the paged pool, together) and ``tuned.py`` (``TunedKernels``, what
``minillm.load(..., kernels="tuned")`` gives the model). It imports the textbook (``minillm/model``)
and is never imported by it.
"""
