"""The transformer: token ids + a KV cache -> logits. The one forward pass minillm has.

Read top to bottom: ``forward`` embeds the tokens and runs every ``decoder_layer``: an
``attention_block`` and an ``mlp_block``, each added to the residual stream::

    x = embed(ids) [* sqrt(d_model): Gemma] [+ learned positions: GPT-2]
    per layer:  h = norm(x)                          RMSNorm | LayerNorm (GPT-2)
                q, k, v = h @ W_qkv.T [+ b_qkv]       biases: GPT-2, Qwen 2
                q, k = norm(q), norm(k)               QK-norm: Qwen 3, Gemma 3
                q, k = RoPE(q), RoPE(k)               not GPT-2; Gemma's sliding layers: own base
                z = attention(q, K, V, mask)          causal | sliding-window mask; K, V from the cache
                a = z @ W_o.T [+ b_o]; [a = norm(a)]  post-norm: Gemma 3
                x = x + a
                h = norm(x); m = MLP(h); [m = norm(m)]  SwiGLU | GeGLU | GPT-2's plain MLP
                x = x + m
    logits = norm(x) @ W_head.T [soft-capped, if final_logit_softcapping is set]

``prefill`` and ``decode_step`` (``runtime/steps.py``) both call ``forward``, feeding more or fewer
positions from the cache's ``length`` (masks: the same rule with that offset). ``forward_batch``
is the same pass (:meth:`Transformer.run_pass`) over several sequences' chunks: rows stacked,
attention per sequence; the head is its own call (:meth:`Transformer.compute_logits`). Families
differ only by ``ModelConfig`` flags (``families.py``); the math is ``primitives.py``. The seam is
crossed twice (``kernels.py``): ``kernels.prepare(weights)`` once at load, ``kernels.begin(...)``
once per pass, which returns the pass (``passes.py``) whose ``linear`` and ``attend`` the layers
call with arrays and matrices only (plain NumPy here; ``minillm.load`` gives the engine room's
tuned kernels). LoRA adds its low-rank paths inside ``LayerWeights.project`` (``lora.py``);
capture is the pass's ``record``, with TransformerLens names (embed, resid_pre, q, k, v, rot_q,
rot_k, pattern, z, attn_out, resid_mid, mlp_out, resid_post). Reference: transformers' ``models/*/modeling_*.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minillm.errors import InvalidRequestError
from minillm.model import primitives
from minillm.model.config import ModelConfig
from minillm.model.families import LayerType, MlpKind, NormKind, PositionKind
from minillm.model.kernels import PLAIN, Kernels
from minillm.model.kv_cache import KVCache
from minillm.model.passes import ForwardPass
from minillm.model.positions import PositionTables
from minillm.model.weights import LayerWeights, Weights


class Transformer:
    """A decoder-only transformer: weights (shared by every request) and its RoPE tables.

    Per-request state (the KV cache) is passed in, never stored here, so one loaded model can
    serve request after request.
    """

    def __init__(self, config: ModelConfig, weights: Weights, kernels: Kernels = PLAIN):
        self.config = config
        self.weights = weights
        self.kernels = kernels.prepare(weights)  # chosen once at load: plain here, tuned from minillm/kernels
        self.act = self.kernels.activation(config.hidden_act)
        self.positions = PositionTables(config)  # RoPE angles and masks per layer type (positions.py)
        self.layer_types, self.inv_freq = self.positions.layer_types, self.positions.inv_freq

    # --- per-call tables: RoPE angles and masks ------------------------------------------------------
    def rope(self, positions: np.ndarray, layer_type: LayerType = LayerType.FULL) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin ``[seq, head_dim]`` for ``positions`` in layers of ``layer_type`` (``PositionTables.rope``)."""
        return self.positions.rope(positions, layer_type)

    def masks(self, seq: int, start: int) -> dict[LayerType, np.ndarray]:
        """The additive mask ``[seq, start + seq]`` per layer type present in this model."""
        return self.positions.masks(seq, start, self.kernels)

    def norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """The family's norm over the last axis: RMSNorm, or LayerNorm with bias (GPT-2)."""
        if self.config.norm is NormKind.LAYERNORM:
            return primitives.layer_norm(x, weight, bias, self.config.norm_eps)
        return self.kernels.rms_norm(x, weight, self.config.norm_eps)

    # --- the forward pass ----------------------------------------------------------------------------
    def forward(
        self, token_ids: np.ndarray, cache: KVCache | None = None, *, last_only: bool = False, capture=None
    ) -> np.ndarray:
        """Run the model over ``token_ids`` at positions ``cache.length ..``.

        Args:
            token_ids: ``[seq]`` integer ids.
            cache: the request's KV cache, written at ``cache.length..+seq`` and advanced by
                ``seq``. ``None`` attends over these ``seq`` tokens only (a full recomputation,
                the "no cache" baseline).
            last_only: compute logits for the last position only (what generation needs; saves
                a ``[seq, d_model] @ [d_model, vocab]`` product in prefill).
            capture: if a dict, intermediates are stored in it under TransformerLens names
                (``embed``, ``blocks.{i}.attn.pattern`` ``[n_heads, seq, ctx]``,
                ``blocks.{i}.resid_post`` ``[seq, d_model]``, ...).

        Returns:
            float32 logits ``[seq, vocab]`` (``[1, vocab]`` with ``last_only``).

        One sequence's pass (``kernels.begin``: its rows are one sequence's, attended by the
        textbook's steps in ``passes.py``), then :meth:`compute_logits`.

        Raises:
            InvalidRequestError: no tokens.
            KVCacheFullError: the cache has no room for ``seq`` more positions.
            KVCacheMismatchError: the cache was built for another model.
        """
        hidden, fwd = self.run_pass([(token_ids, cache)], [1] if last_only else None, capture=capture)
        return self.compute_logits(hidden, fwd)

    def forward_batch(
        self,
        chunks: Sequence[tuple[np.ndarray, KVCache]],
        *,
        all_logits: bool = False,
        last_rows: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Run several sequences in one pass: each ``(token_ids, cache)`` feeds ``token_ids`` at
        positions ``cache.length..`` of its own cache (a decode row is one id, a prefill chunk many).

        The rows of every sequence are stacked into one ``[rows, d_model]`` matrix, so each
        projection reads its weights once for the whole batch (``[rows, d_model] @ W.T``); that is
        what batching buys, as the weights dominate a decode step's memory traffic. Attention alone
        runs per sequence, over that sequence's own cached keys and values with its own causal mask
        (the pass's ``attend``): rows of different sequences never see each other. Each row gets
        the same numbers as :meth:`forward` on that sequence alone, up to float32 rounding of the
        products (BLAS sums a matrix product in another order than a matrix-vector product).

        Args:
            chunks: ``(token_ids [seq_j] int, cache)`` per sequence; ``cache`` is a :class:`KVCache`
                or anything with its interface (a paged cache's sequence, ``paged_kv_cache.py``).
                Each cache is written at ``cache.length..+seq_j`` and advanced by ``seq_j``.
            all_logits: return logits for every row (tests, lessons) instead of the last row of
                each sequence (what sampling needs; saves the LM head's work on prefill rows).
            last_rows: how many of each sequence's last rows get logits (default 1 each).

        Returns:
            float32 logits ``[n_sequences, vocab]`` (the last row of each chunk), or
            ``[rows, vocab]`` with ``all_logits`` (rows in the order of ``chunks``), or
            ``[sum(last_rows), vocab]`` with ``last_rows``.

        Raises:
            InvalidRequestError: no chunks, or a chunk without tokens.
            KVCacheFullError / KVCacheMismatchError: as :meth:`forward`, for any sequence.
        """
        if last_rows is None and not all_logits:
            last_rows = [1] * len(chunks)  # each sequence's last row: what sampling needs
        hidden, fwd = self.run_pass(chunks, last_rows, batch=True)
        return self.compute_logits(hidden, fwd)

    def hidden_batch(self, chunks: Sequence[tuple[np.ndarray, KVCache]]) -> np.ndarray:
        """:meth:`forward_batch` without the head: every row's residual stream ``[rows, d_model]``
        before the final norm, for :meth:`compute_logits` to score later, row by row (speculative
        verification scores a row only when every draft before it was kept)."""
        return self.run_pass(chunks, None, batch=True)[0]

    def run_pass(self, chunks, last_rows: Sequence[int] | None, *, batch: bool = False, capture=None):
        """The one forward pass over ``chunks`` (``(token_ids [seq_j], cache or None)`` each): every
        chunk's rows stacked into one ``[rows, d_model]`` residual stream, through every layer.

        ``last_rows``: keep each chunk's last ``last_rows[j]`` rows, ``[sum(last_rows), d_model]``;
        None: every row. ``batch``: the rows are a batch's (``forward_batch``). Returns those rows'
        residual stream and the pass (:meth:`compute_logits` takes its products).
        """
        if not chunks:
            raise InvalidRequestError("a forward pass got no sequences; pass at least one (token_ids, cache) pair.")
        ids, positions = self._chunks(chunks)
        fwd = self.kernels.begin(
            self.config, self.positions, [(p, c) for p, (_, c) in zip(positions, chunks, strict=True)],
            batch=batch, capture=capture,
        )  # fmt: skip
        x = self.embed(np.concatenate(ids), np.concatenate(positions))  # [rows, d_model]
        fwd.record(None, embed=x)
        for i, layer in enumerate(self.weights.layers):
            x = self.decoder_layer(i, x, layer, fwd)
        fwd.finish()
        if last_rows is not None:  # [sum(last_rows), d_model]: each chunk's last rows, in order
            ends = fwd.bounds[1:]
            x = x[np.concatenate([np.arange(end - m, end) for end, m in zip(ends, last_rows, strict=True)])]
        return x, fwd

    def _chunks(self, chunks) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each chunk's ids ``[seq_j]`` int64 and positions ``cache.length..+seq_j``; every cache
        checked (the one room check of a forward pass)."""
        ids, positions = [], []
        for j, (token_ids, cache) in enumerate(chunks):
            token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
            if len(token_ids) == 0:
                raise InvalidRequestError(f"sequence {j} of this forward pass has no tokens; feed at least one.")
            start = 0
            if cache is not None:
                cache.check_compatible(self.config)
                cache.check_room(len(token_ids))
                start = cache.length
            ids.append(token_ids)
            positions.append(np.arange(start, start + len(token_ids)))  # [seq_j]
        return ids, positions

    # --- the pieces of a forward pass ---------------------------------------------------------------
    def embed(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Token ids ``[seq]`` at absolute ``positions`` ``[seq]`` -> the residual stream ``[seq, d_model]``."""
        cfg, w = self.config, self.weights
        x = w.embed_tokens.take(token_ids)  # [seq, d_model], float32 however the table is held
        if cfg.embed_scale is not None:  # Gemma: sqrt(d_model), in the activation dtype (float32)
            x = x * np.float32(cfg.embed_scale)
        if cfg.position_embedding is PositionKind.LEARNED:  # GPT-2: a learned vector per absolute position
            x = x + w.pos_embed[positions]
        return x

    def compute_logits(self, hidden: np.ndarray, fwd: ForwardPass | None = None) -> np.ndarray:
        """The residual stream ``[seq, d_model]`` -> logits ``[seq, vocab]``: final norm, LM head,
        soft-cap. ``fwd``: the pass these rows came from (its products: a batch's), None: the
        kernels' own product (rows scored one at a time)."""
        cfg, w = self.config, self.weights
        x = self.norm(hidden, w.final_norm, w.final_norm_bias)
        logits = (self.kernels if fwd is None else fwd).linear(x, w.lm_head)  # [seq, vocab]
        if cfg.final_logit_softcapping is not None:
            logits = primitives.softcap(logits, cfg.final_logit_softcapping)
        return logits

    def decoder_layer(self, i, x, layer: LayerWeights, fwd: ForwardPass) -> np.ndarray:
        """Decoder block ``i``: ``x + attention(norm(x))``, then ``+ mlp(norm(.))``; ``x`` ``[seq, d_model]``
        in, the same shape out. ``fwd`` is the pass (``passes.py``): its products and attention."""
        cfg = self.config
        attn_out = self.attention_block(i, self.norm(x, layer.attn_norm, layer.attn_norm_bias), layer, fwd)
        if cfg.post_norms:  # Gemma: normalise what attention adds
            attn_out = self.norm(attn_out, layer.attn_post_norm)
        resid_mid = x + attn_out
        h = self.norm(resid_mid, layer.mlp_norm, layer.mlp_norm_bias)
        mlp_out = self.mlp_block(h, layer, fwd)  # [seq, d_model]
        if cfg.post_norms:
            mlp_out = self.norm(mlp_out, layer.mlp_post_norm)
        resid_post = resid_mid + mlp_out
        fwd.record(i, resid_pre=x, attn_out=attn_out, resid_mid=resid_mid, mlp_out=mlp_out, resid_post=resid_post)
        return resid_post

    def attention_block(self, i, h, layer: LayerWeights, fwd: ForwardPass) -> np.ndarray:
        """Self-attention over the normed ``h`` ``[seq, d_model]`` -> what it adds, ``[seq, d_model]``:
        q, k, v from one fused projection (every row at once), the pass's ``attend`` per sequence
        (QK-norm, RoPE, the cache, the mask: ``passes.ForwardPass.attend_sequence``), then the output
        projection (every row at once)."""
        qkv = layer.project("qkv", h, fwd.linear)  # [seq, q_dim + 2 kv_dim]
        z = fwd.attend(i, qkv, layer.q_norm, layer.k_norm)  # [seq, q_dim]
        return layer.project("o", z, fwd.linear)  # [seq, d_model]

    def mlp_block(self, h: np.ndarray, layer: LayerWeights, fwd: ForwardPass) -> np.ndarray:
        """The family's MLP on the normed ``h`` ``[seq, d_model]`` -> ``[seq, d_model]``.

        Gated (SwiGLU with SiLU, GeGLU with GELU; Shazeer 2020): ``down(act(gate(h)) * up(h))``.
        Plain (GPT-2): ``down(act(up(h)))``.
        """
        if self.config.mlp is MlpKind.GATED:
            gate_up = layer.project("gate_up", h, fwd.linear)  # [seq, 2 * ffn]: gate | up
            ffn = self.config.intermediate_size
            gate, up = gate_up[:, :ffn], gate_up[:, ffn:]  # each [seq, ffn], views
            act = self.act(gate)  # a fresh array: multiplied by up in place
            act *= up
            return layer.project("down", act, fwd.linear)
        up = layer.project("up", h, fwd.linear)
        return layer.project("down", self.act(up), fwd.linear)
