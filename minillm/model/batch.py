"""Attention for a batch of sequences in one forward pass (``Transformer.forward_batch``).

Every projection takes the rows of all sequences at once; attention cannot: each row must see only
its own sequence's keys and values, under its own causal mask. :class:`BatchAttention` splits the
rows by sequence and runs each through the one-sequence path (``transformer.SequenceAttention``),
exactly as ``Transformer.forward`` runs it. The engine room's ``TunedKernels`` attends a batch's
decode rows over one paged pool together instead (``minillm/kernels/paged_decode.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: ``attend(i, layer, qkv, hook) -> z``: the per-sequence part of attention in layer ``i``, ``qkv``
#: ``[seq, q_dim + 2 kv_dim]`` -> ``z`` ``[seq, q_dim]`` (``transformer.SequenceAttention``, :class:`BatchAttention`).
Attend = Callable[..., np.ndarray]


class BatchAttention:
    """Attention for a batch: sequence ``j`` owns rows ``bounds[j]:bounds[j+1]`` of ``qkv`` and attends
    over its own cache with its own mask (``sequences[j]``), so no row ever sees another sequence's
    keys. Intermediates are not captured here (``forward`` captures one sequence). Sequences listed
    in ``skip`` are left to a subclass (the engine room's grouped decode rows).
    """

    def __init__(self, q_dim: int, sequences: list[Attend], bounds, skip=()):
        self.q_dim = q_dim
        self.alone = [(sequences[j], bounds[j], bounds[j + 1]) for j in range(len(sequences)) if j not in skip]

    def __call__(self, i: int, layer, qkv: np.ndarray, hook: Callable | None = None) -> np.ndarray:
        z = np.empty((qkv.shape[0], self.q_dim), dtype=np.float32)  # [rows, q_dim]
        self.attend_alone(i, layer, qkv, z)
        return z

    def attend_alone(self, i: int, layer, qkv: np.ndarray, z: np.ndarray) -> None:
        """Each sequence's rows of ``z`` ``[rows, q_dim]``, one sequence at a time."""
        for sequence, a, b in self.alone:
            z[a:b] = sequence(i, layer, qkv[a:b])
