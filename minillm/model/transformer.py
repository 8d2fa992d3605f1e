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
is the same pass (:meth:`Transformer.run`) over several sequences' chunks: rows stacked, attention
per sequence (``batch.py``). Families differ only by ``ModelConfig`` flags (``families.py``); the
math is ``primitives.py``. Products and attention go through the model's ``kernels``
(``kernels.py``: plain NumPy here; ``minillm.load`` gives the engine room's tuned ones).
LoRA adds its low-rank paths inside ``LayerWeights.project`` (``lora.py``); capture is a ``hook``
the blocks call with TransformerLens names (embed, resid_pre, q, k, v, rot_q, rot_k, pattern, z,
attn_out, resid_mid, mlp_out, resid_post). Reference: transformers' ``models/*/modeling_*.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from minillm.errors import InvalidRequestError
from minillm.model import primitives
from minillm.model.batch import Attend
from minillm.model.config import ModelConfig
from minillm.model.families import LayerType, MlpKind, NormKind, PositionKind
from minillm.model.kernels import PLAIN, Kernels
from minillm.model.kv_cache import KVCache
from minillm.model.positions import PositionTables
from minillm.model.weights import LayerWeights, Weights

#: ``hook(**intermediates)``: called once per block with its named arrays (capture, lessons).
Hook = Callable[..., None]


class Transformer:
    """A decoder-only transformer: weights (shared by every request) and its RoPE tables.

    Per-request state (the KV cache) is passed in, never stored here, so one loaded model can
    serve request after request.
    """

    def __init__(self, config: ModelConfig, weights: Weights, kernels: Kernels = PLAIN):
        self.config = config
        self.weights = weights
        self.kernels = kernels  # linear, attention, batch attention: plain here, tuned from minillm/kernels
        self.act = primitives.ACTIVATIONS[config.hidden_act]
        self.positions = PositionTables(config)  # RoPE angles and masks per layer type (positions.py)
        self.layer_types, self.inv_freq = self.positions.layer_types, self.positions.inv_freq

    # --- per-call tables: RoPE angles and masks ------------------------------------------------------
    def rope(self, positions: np.ndarray, layer_type: LayerType = LayerType.FULL) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin ``[seq, head_dim]`` for ``positions`` in layers of ``layer_type`` (``PositionTables.rope``)."""
        return self.positions.rope(positions, layer_type)

    def masks(self, seq: int, start: int) -> dict[LayerType, np.ndarray]:
        """The additive mask ``[seq, start + seq]`` per layer type present in this model."""
        return self.positions.masks(seq, start)

    def norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """The family's norm over the last axis: RMSNorm, or LayerNorm with bias (GPT-2)."""
        if self.config.norm is NormKind.LAYERNORM:
            return primitives.layer_norm(x, weight, bias, self.config.norm_eps)
        return primitives.rms_norm(x, weight, self.config.norm_eps)

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

        One chunk of the pass :meth:`forward_batch` runs (:meth:`run`), with the kernels' one-sequence
        forms (no batched products; attention through ``SequenceAttention``).

        Raises:
            InvalidRequestError: no tokens.
            KVCacheFullError: the cache has no room for ``seq`` more positions.
            KVCacheMismatchError: the cache was built for another model.
        """
        return self.run([(token_ids, cache)], batched=False, last_rows=[1] if last_only else None, capture=capture)

    def forward_batch(
        self,
        chunks: Sequence[tuple[np.ndarray, KVCache]],
        *,
        all_logits: bool = False,
        last_rows: Sequence[int] | None = None,
        logits: bool = True,
    ) -> np.ndarray:
        """Run several sequences in one pass: each ``(token_ids, cache)`` feeds ``token_ids`` at
        positions ``cache.length..`` of its own cache (a decode row is one id, a prefill chunk many).

        The rows of every sequence are stacked into one ``[rows, d_model]`` matrix, so each
        projection reads its weights once for the whole batch (``[rows, d_model] @ W.T``); that is
        what batching buys, as the weights dominate a decode step's memory traffic. Attention alone
        runs per sequence, over that sequence's own cached keys and values with its own causal mask
        (``kernels.batch_attention``): rows of different sequences never see each other. Each row gets
        the same numbers as :meth:`forward` on that sequence alone, up to float32 rounding of the
        products (BLAS sums a matrix product in another order than a matrix-vector product).

        Args:
            chunks: ``(token_ids [seq_j] int, cache)`` per sequence; ``cache`` is a :class:`KVCache`
                or anything with its interface (a paged cache's sequence, ``paged_kv_cache.py``).
                Each cache is written at ``cache.length..+seq_j`` and advanced by ``seq_j``.
            all_logits: return logits for every row (tests, lessons) instead of the last row of
                each sequence (what sampling needs; saves the LM head's work on prefill rows).
            last_rows: how many of each sequence's last rows get logits (default 1 each); speculative
                decoding verifies ``k`` drafted tokens with the logits of a chunk's last ``k + 1`` rows.
            logits: False: return those rows' residual stream ``[rows, d_model]`` before the final
                norm, for :meth:`head` to score later, row by row (speculative verification scores a
                row only when every draft before it was kept).

        Returns:
            float32 logits ``[n_sequences, vocab]`` (the last row of each chunk), or
            ``[rows, vocab]`` with ``all_logits`` (rows in the order of ``chunks``), or
            ``[sum(last_rows), vocab]`` with ``last_rows``.

        Raises:
            InvalidRequestError: no chunks, or a chunk without tokens.
            KVCacheFullError / KVCacheMismatchError: as :meth:`forward`, for any sequence.
        """
        if not chunks:
            raise InvalidRequestError("forward_batch got no sequences; pass at least one (token_ids, cache) pair.")
        if last_rows is None and not all_logits:
            last_rows = [1] * len(chunks)  # each sequence's last row: what sampling needs
        return self.run(chunks, batched=True, last_rows=last_rows, logits=logits)

    def run(
        self, chunks, *, batched: bool, last_rows: Sequence[int] | None, capture=None, logits: bool = True
    ) -> np.ndarray:
        """The one forward pass over ``chunks`` (``(token_ids [seq_j], cache or None)`` each): every
        chunk's rows stacked into one ``[rows, d_model]`` residual stream, every layer, the head.

        ``batched``: the rows are a batch's (the kernels may take their few-rows products, and
        attention is ``kernels.batch_attention``); False: one sequence, attended by its own
        :class:`SequenceAttention`. ``last_rows``: logits of each chunk's last ``last_rows[j]`` rows,
        ``[sum(last_rows), vocab]``; None: every row, ``[rows, vocab]``. ``capture``: as :meth:`forward`.
        ``logits`` False: those rows' residual stream ``[rows, d_model]``, the head not applied.
        """
        ids, positions, sequences = self._chunks(chunks)
        caches = [cache for _, cache in chunks]
        bounds = np.cumsum([0] + [len(t) for t in ids])  # chunk j owns rows bounds[j]:bounds[j+1]
        attend = self.kernels.batch_attention(self, sequences, caches, bounds) if batched else sequences[0]

        x = self.embed(np.concatenate(ids), np.concatenate(positions))  # [rows, d_model]
        if capture is not None:
            capture["embed"] = x
        for i, layer in enumerate(self.weights.layers):
            hook = None if capture is None else _recorder(capture, f"blocks.{i}.")
            x = self.decoder_layer(i, x, layer, attend, hook, batched=batched)
        for token_ids, cache in zip(ids, caches, strict=True):
            if cache is not None:
                cache.advance(len(token_ids))
        if last_rows is not None:  # [sum(last_rows), d_model]: each chunk's last rows, in order
            x = x[np.concatenate([np.arange(end - m, end) for end, m in zip(bounds[1:], last_rows, strict=True)])]
        return self.head(x, batched=batched) if logits else x

    def _chunks(self, chunks) -> tuple[list[np.ndarray], list[np.ndarray], list[SequenceAttention]]:
        """Each chunk's ids ``[seq_j]`` int64, positions ``cache.length..+seq_j`` and attention; every
        cache checked (the one room check of a forward pass)."""
        ids, positions, sequences = [], [], []
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
            sequences.append(SequenceAttention(self, positions[-1], cache))  # its RoPE angles, masks and cache
        return ids, positions, sequences

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

    def head(self, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        """The residual stream ``[seq, d_model]`` -> logits ``[seq, vocab]``: final norm, LM head, soft-cap."""
        cfg, w = self.config, self.weights
        x = self.norm(x, w.final_norm, w.final_norm_bias)
        logits = self.kernels.linear(x, w.lm_head, projection="lm_head", batched=batched)  # [seq, vocab]
        if cfg.final_logit_softcapping is not None:
            logits = primitives.softcap(logits, cfg.final_logit_softcapping)
        return logits

    def decoder_layer(
        self, i, x, layer: LayerWeights, attend: Attend, hook: Hook | None = None, *, batched: bool = False
    ) -> np.ndarray:
        """Decoder block ``i``: ``x + attention(norm(x))``, then ``+ mlp(norm(.))``; ``x`` ``[seq, d_model]``
        in, the same shape out. ``attend`` does the per-sequence part of attention (RoPE, the cache,
        the mask): a :class:`SequenceAttention` for one sequence, ``kernels.batch_attention``'s for many.
        ``batched``: the rows are a batch's (passed on to the kernels' products).
        """
        cfg = self.config
        attn_out = self.attention_block(
            i, self.norm(x, layer.attn_norm, layer.attn_norm_bias), layer, attend, hook, batched=batched
        )  # [seq, d_model]
        if cfg.post_norms:  # Gemma: normalise what attention adds
            attn_out = self.norm(attn_out, layer.attn_post_norm)
        resid_mid = x + attn_out
        h = self.norm(resid_mid, layer.mlp_norm, layer.mlp_norm_bias)
        mlp_out = self.mlp_block(h, layer, batched=batched)  # [seq, d_model]
        if cfg.post_norms:
            mlp_out = self.norm(mlp_out, layer.mlp_post_norm)
        resid_post = resid_mid + mlp_out
        if hook is not None:
            hook(resid_pre=x, attn_out=attn_out, resid_mid=resid_mid, mlp_out=mlp_out, resid_post=resid_post)
        return resid_post

    def attention_block(
        self, i, h, layer: LayerWeights, attend: Attend, hook: Hook | None = None, *, batched: bool = False
    ) -> np.ndarray:
        """Self-attention over the normed ``h`` ``[seq, d_model]`` -> what it adds, ``[seq, d_model]``:
        q, k, v from one fused projection (every row at once), ``attend`` per sequence, then the
        output projection (every row at once)."""
        qkv = layer.project("qkv", h, self.kernels, batched=batched)  # [seq, q_dim + 2 kv_dim]
        z = attend(i, layer, qkv, hook)  # [seq, q_dim]
        return layer.project("o", z, self.kernels, batched=batched)  # [seq, d_model]

    def attention(self, i, layer: LayerWeights, qkv, rope, mask, cache=None, hook: Hook | None = None) -> np.ndarray:
        """One sequence's attention in layer ``i``: ``qkv`` ``[seq, q_dim + 2 kv_dim]`` -> ``z``
        ``[seq, q_dim]`` (heads side by side). QK-norm and RoPE on q and k; this call's k and v
        written to the cache, and attention over every filled position (Vaswani et al. 2017).
        ``rope``: (cos, sin) ``[seq, head_dim]`` for this layer's type, None without RoPE;
        ``mask``: ``[seq, ctx]`` additive; ``cache``: a KVCache written at layer ``i``.
        """
        cfg = self.config
        seq = qkv.shape[0]
        n_heads, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, k, v = qkv[:, : cfg.q_dim], qkv[:, cfg.q_dim : -cfg.kv_dim], qkv[:, -cfg.kv_dim :]  # views
        q = q.reshape(seq, n_heads, hd).transpose(1, 0, 2)  # [n_heads, seq, head_dim]
        k = k.reshape(seq, n_kv, hd).transpose(1, 0, 2)  # [n_kv_heads, seq, head_dim]
        v = v.reshape(seq, n_kv, hd).transpose(1, 0, 2)  # [n_kv_heads, seq, head_dim]
        rot_q, rot_k = self.rotate(layer, q, k, rope)
        # the cache keeps keys already rotated: a key's position never changes
        keys, values = (rot_k, v) if cache is None else cache.write(i, rot_k, v)  # [n_kv_heads, ctx, head_dim]
        if hook is None:
            z = self.kernels.attention(rot_q, keys, values, mask, cfg.attn_scale)  # [n_heads, seq, head_dim]
        else:  # capture: the probabilities too, which only the one-call form has
            z, pattern = primitives.attention(rot_q, keys, values, mask, cfg.attn_scale)
            named = {"q": q, "k": k, "v": v, "rot_q": rot_q, "rot_k": rot_k, "pattern": pattern, "z": z}
            hook(**{"attn." + name: value for name, value in named.items()})
        return z.transpose(1, 0, 2).reshape(seq, cfg.q_dim)  # [seq, n_heads * head_dim]

    def rotate(self, layer: LayerWeights, q: np.ndarray, k: np.ndarray, rope) -> tuple[np.ndarray, np.ndarray]:
        """QK-norm (Qwen 3, Gemma 3: each head's q and k to unit RMS) then RoPE on ``q``, ``k``
        ``[..., heads, seq, head_dim]``; ``rope``: (cos, sin) broadcasting to them, None without RoPE."""
        cfg = self.config
        if cfg.qk_norm:
            q = primitives.rms_norm(q, layer.q_norm, cfg.norm_eps)
            k = primitives.rms_norm(k, layer.k_norm, cfg.norm_eps)
        if rope is not None:
            cos, sin = rope
            q = primitives.apply_rope(q, cos, sin)
            k = primitives.apply_rope(k, cos, sin)
        return q, k

    def mlp_block(self, h: np.ndarray, layer: LayerWeights, *, batched: bool = False) -> np.ndarray:
        """The family's MLP on the normed ``h`` ``[seq, d_model]`` -> ``[seq, d_model]``.

        Gated (SwiGLU with SiLU, GeGLU with GELU; Shazeer 2020): ``down(act(gate(h)) * up(h))``.
        Plain (GPT-2): ``down(act(up(h)))``.
        """
        if self.config.mlp is MlpKind.GATED:
            gate_up = layer.project("gate_up", h, self.kernels, batched=batched)  # [seq, 2 * ffn]: gate | up
            ffn = self.config.intermediate_size
            gate, up = gate_up[:, :ffn], gate_up[:, ffn:]  # each [seq, ffn], views
            act = self.act(gate)  # a fresh array: multiplied by up in place
            act *= up
            return layer.project("down", act, self.kernels, batched=batched)
        up = layer.project("up", h, self.kernels, batched=batched)
        return layer.project("down", self.act(up), self.kernels, batched=batched)


class SequenceAttention:
    """The per-sequence part of attention for one forward pass: this sequence's RoPE angles and masks
    (from its positions) and its KV cache. Called once per layer: ``attend(i, layer, qkv, hook) -> z``.
    """

    def __init__(self, model: Transformer, positions: np.ndarray, cache: KVCache | None):
        self.model, self.cache = model, cache
        self.rope = {t: model.rope(positions, t) for t in model.inv_freq}  # layer type -> (cos, sin) [seq, head_dim]
        self.masks = model.masks(len(positions), int(positions[0]))  # layer type -> [seq, ctx]

    def __call__(self, i: int, layer: LayerWeights, qkv: np.ndarray, hook: Hook | None = None) -> np.ndarray:
        layer_type = self.model.layer_types[i]
        return self.model.attention(i, layer, qkv, self.rope.get(layer_type), self.masks[layer_type], self.cache, hook)


def _recorder(capture: dict[str, np.ndarray], prefix: str) -> Hook:
    """A hook that stores each named intermediate in ``capture`` under ``prefix + name``."""

    def record(**named: np.ndarray) -> None:
        capture.update({prefix + name: value for name, value in named.items()})

    return record
