"""What a forward pass computes from its positions alone: RoPE angles and attention masks, per layer type.

A :class:`PositionTables` belongs to one model (its config decides the layer types and RoPE speeds;
``transformer.py`` builds it); each forward pass (``passes.py``) and the engine room's paged decode
rows (``kernels/paged_decode.py``) ask it for the angles and masks of the positions they feed.
"""

from __future__ import annotations

import numpy as np

from minillm.model import primitives
from minillm.model.config import ModelConfig
from minillm.model.families import LayerType, PositionKind


class PositionTables:
    """A model's RoPE speeds per layer type and its cos/sin tables (grown on need); masks per call.

    ``layer_types``: one :class:`LayerType` per layer; ``inv_freq``: layer type -> ``[head_dim/2]``
    float32, empty without RoPE (GPT-2).
    """

    def __init__(self, config: ModelConfig):
        self.config = config
        self.layer_types = [config.layer_type(i) for i in range(config.num_hidden_layers)]
        # RoPE speeds per layer type: Gemma 3's sliding layers turn with their own (local) base.
        self.inv_freq: dict[LayerType, np.ndarray] = {}
        if config.position_embedding is PositionKind.ROPE:
            full = primitives.rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
            self.inv_freq[LayerType.FULL] = full
            if LayerType.SLIDING in self.layer_types:
                local = config.rope_local_theta
                self.inv_freq[LayerType.SLIDING] = (
                    full if local is None else primitives.rope_inverse_frequencies(config.head_dim, local)
                )
        empty = np.zeros((0, config.head_dim), dtype=np.float32)
        self._tables = {t: (empty, empty) for t in self.inv_freq}  # layer type -> (cos, sin) [n, head_dim]

    def rope(self, positions: np.ndarray, layer_type: LayerType = LayerType.FULL) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin ``[seq, head_dim]`` for ``positions`` in layers of ``layer_type``; the tables
        are computed once and grown on need."""
        cos, sin = self._tables[layer_type]
        needed = int(positions.max()) + 1
        if needed > len(cos):
            size = max(needed, min(2 * len(cos), self.config.max_position_embeddings), 256)
            cos, sin = self._tables[layer_type] = primitives.rope_tables(np.arange(size), self.inv_freq[layer_type])
        return cos[positions], sin[positions]

    def masks(self, seq: int, start: int, units=primitives) -> dict[LayerType, np.ndarray]:
        """The additive mask ``[seq, start + seq]`` per layer type present in this model, built by
        ``units.causal_mask`` and ``units.sliding_window_mask`` (the textbook's ``primitives``, or a
        forward pass's kernels: ``Kernels``, where a student's masks plug in)."""
        masks = {LayerType.FULL: units.causal_mask(seq, start + seq, offset=start)}
        if LayerType.SLIDING in self.layer_types:
            masks[LayerType.SLIDING] = units.sliding_window_mask(
                seq, start + seq, offset=start, window=self.config.sliding_window
            )
        return masks
