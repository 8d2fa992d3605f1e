"""From what the runtime reports to what the trace shows: one function per phase.

The runtime tells a listener *facts* (token ids, the sampler's probabilities, seconds, the stop
reason) and hands it the :class:`~minillm.runtime.loading.Model` for context. These functions
turn them into the plain data a :class:`~minillm.observe.events.TraceEvent` carries: pieces a
person can read, the top candidates, the causal mask as a picture, the stop's sentence, the
memory tables and the diagnosis (``describe_summary.py``; the pictures are ``pictures.py``'s).
Nothing here runs unless someone listens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minillm.model.config import ModelConfig
from minillm.model.families import LayerType, MlpKind, NormKind, PositionKind
from minillm.observe.describe_summary import (  # noqa: F401 (summary: a phase, re-exported)
    expectations,
    local_load_s,
    prepare_expectations,
    summary,
)
from minillm.observe.metrics import blas_summary
from minillm.observe.pictures import block_table_picture, mask_picture, pool_picture
from minillm.runtime.sampling import top_candidates
from minillm.runtime.stopping import StopReason

MASK_GRID_MAX = 12  # draw the causal mask as a grid for prompts up to this many tokens
CANDIDATES = 5  # candidates shown per step


def config_rows(config: ModelConfig) -> dict[str, Any]:
    """The rows a trace shows at load: the shapes, then the flags that set this family apart.

    Every model shows family, sizes, norm, positions and MLP; a flag appears only when it
    differs from a plain Llama (biases, QK-norm, post-norms, embedding scale, attention scale,
    sliding windows, soft-capping, RoPE scaling), so the rows that show *are* the differences.
    """
    rows: dict[str, Any] = {
        "family": config.family if config.family == config.model_type else f"{config.family} ({config.model_type})",
        "layers": config.num_hidden_layers,
        "d_model": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "ffn": config.intermediate_size,
        "vocab": config.vocab_size,
        "context": config.max_position_embeddings,
    }
    norm = "LayerNorm (with bias)" if config.norm is NormKind.LAYERNORM else "RMSNorm"
    rows["norm"] = norm + (" x (1 + w)" if config.norm_weight_offset else "") + f", eps {config.norm_eps:g}"
    if config.position_embedding is PositionKind.LEARNED:
        rows["positions"] = f"learned table [{config.max_position_embeddings}, {config.hidden_size}]"
    else:
        rows["positions"] = f"RoPE theta {config.rope_theta:g}"
        if config.rope_scaling:
            rows["rope_scaling"] = ", ".join(f"{k} {v}" for k, v in config.rope_scaling.items())
        if config.rope_local_theta is not None and LayerType.SLIDING in config.layer_types:
            rows["rope_local_theta"] = f"{config.rope_local_theta:g} (sliding layers)"
    act = {"silu": "SiLU", "gelu_tanh": "GELU tanh"}.get(config.hidden_act, config.hidden_act)
    glu = {"silu": "SwiGLU", "gelu_tanh": "GeGLU"}.get(config.hidden_act, f"gated {act}")
    rows["mlp"] = glu if config.mlp is MlpKind.GATED else f"up, {act}, down"
    if config.qkv_bias or config.o_bias or config.mlp_bias:
        rows["biases"] = ", ".join(
            n for n, on in (("q/k/v", config.qkv_bias), ("o", config.o_bias), ("mlp", config.mlp_bias)) if on
        )
    if config.qk_norm:
        rows["qk_norm"] = "RMSNorm on q and k (per head)"
    if config.post_norms:
        rows["post_norms"] = "after attention and after MLP"
    if config.embed_scale is not None:
        rows["embed_scale"] = f"{config.embed_scale:.4f} (sqrt d_model)"
    if config.query_pre_attn_scalar is not None:
        rows["attn_scale"] = f"query_pre_attn_scalar {config.query_pre_attn_scalar:g} ** -0.5"
    if LayerType.SLIDING in config.layer_types:
        n = config.layer_types.count(LayerType.SLIDING)
        rows["sliding_window"] = f"{config.sliding_window} on {n} of {config.num_hidden_layers} layers"
    if config.final_logit_softcapping is not None:
        rows["logit_softcap"] = config.final_logit_softcapping
    rows["tied_lm_head"] = config.tie_word_embeddings
    return rows


def describe_stop(
    reason: StopReason,
    condition,
    *,
    n_new: int,
    max_new_tokens: int,
    n_prompt: int,
    window: int,
    elapsed_s: float,
    include: bool = False,
    eos_ids=(),
    eos_text: str = "",
) -> str:
    """The trace's sentence for a stop: which condition fired, with its numbers.

    ``condition`` is what fired (the EOS id, the stop string, the id sequence, the timeout in
    seconds, what cancelled); ``window`` the positions the request could use (cache size).
    """
    if reason is StopReason.EOS:
        return f"token {condition} {eos_text!r} is in the EOS set {list(eos_ids)}"
    if reason is StopReason.MAX_NEW_TOKENS:
        return f"{n_new} new tokens = max_new_tokens {max_new_tokens}"
    if reason is StopReason.STOP_STRING:
        return f"stop string {condition!r} appeared in the text; output cut {'after' if include else 'before'} it"
    if reason is StopReason.STOP_SEQUENCE:
        return (
            f"stop-token sequence {condition} appeared in the new ids; its text is {'kept' if include else 'not shown'}"
        )
    if reason is StopReason.CANCELLED:
        return f"cancelled after {n_new} new token{'' if n_new == 1 else 's'}: {condition}"
    if reason is StopReason.TIMEOUT:
        return (
            f"deadline of {condition} s passed after {elapsed_s:.3f} s and {n_new} new token{'' if n_new == 1 else 's'}"
        )
    return f"prompt {n_prompt} + new {n_new} = {n_prompt + n_new} positions fill the context of {window}"


def _pieces(model, candidates: list[tuple[int, float]]) -> list[tuple[str, float]]:
    """``[(token id, probability)]`` -> ``[(piece as displayed, probability)]``."""
    return [(model.tokenizer.piece_for_display(i), p) for i, p in candidates]


def _candidates(model, probs: np.ndarray | None) -> list[tuple[str, float]]:
    return [] if probs is None else _pieces(model, top_candidates(probs, CANDIDATES))


def load(model, seconds: dict[str, float], others_cpu_share: float = float("nan")) -> dict[str, Any]:
    """The load phase: where the model came from, its config rows, weights, tokenizer, BLAS, the
    kernels the forward runs (``{"name": "tuned", "source": "minillm/kernels"}``), and the share
    (0..1) of the cores other processes used meanwhile (NaN when unknown)."""
    weights, tok, resolved = model.transformer.weights, model.tokenizer, model.resolved
    kernels = getattr(model.transformer, "kernels", None)  # a scripted stand-in may have none
    return dict(
        name=model.name,
        source=resolved.source,
        path=str(model.path),
        notes=list(resolved.notes) + [n for a in model.adapters for n in a.notes],
        config=config_rows(model.config),
        seconds=seconds,
        others_cpu_share=others_cpu_share,
        blas=blas_summary(),
        kernels=None if kernels is None else {"name": kernels.name, "source": kernels.source},
        adapters=[a.summary() for a in model.adapters],
        weights={
            "parameters": weights.num_parameters,
            "bytes_loaded": weights.nbytes,
            "held": {fmt: list(pb) for fmt, pb in weights.formats().items()},  # format -> [parameters, bytes]
            "mapped": weights.mapped,
            "stored": dict(weights.stored_dtypes),
            "bytes_stored": dict(weights.stored_bytes),
            "unused": weights.unused_tensors,
            "seconds": dict(weights.seconds),
        },
        tokenizer={
            "vocab_size": tok.vocab_size,
            "special": " ".join(tok.special_token_texts[:12]),
            "eos_ids": sorted(tok.eos_token_ids),
        },
    )


def warmup(model, tokens: int, decode_steps: int) -> dict[str, Any]:
    """The warm-up request: its size (its seconds are the event's duration), and the diagnosis's
    calibration measured now, while the model warms up, rather than inside a request's step
    (``describe_summary.prepare_expectations``: seconds on a machine not yet calibrated)."""
    return dict(tokens=tokens, decode_steps=decode_steps, calibration=prepare_expectations(model))


def prepare(model, chat: bool, messages: list[dict], text: str) -> dict[str, Any]:
    """The request as the model reads it: the templated text, its special tokens marked."""
    return dict(
        chat=chat,
        messages=messages,
        text=str(text),
        special_tokens=[s for s in model.tokenizer.special_token_texts if s],
    )


def tokenize(model, ids: np.ndarray) -> dict[str, Any]:
    """The prompt's ids and their pieces, leading spaces made visible."""
    tok = model.tokenizer
    ids = [int(i) for i in ids]
    return dict(ids=ids, pieces=[tok.piece_for_display(i) for i in ids], special_ids=sorted(tok.special_token_ids))


def prefill(model, tokens: int, offset: int, cache_length: int, probs: np.ndarray | None, token: int) -> dict[str, Any]:
    """The prefill: positions written, its masks (recomputed from its positions: pictures), top first
    tokens, and the first token sampled from its logits (``token``, its ``piece`` and ``prob``)."""
    cfg, transformer = model.config, model.transformer
    sliding = transformer.layer_types.count(LayerType.SLIDING)
    masks = {}
    if tokens <= MASK_GRID_MAX:  # the masks this forward used, recomputed by the same rule, [seq, ctx] each
        masks = {str(t): mask_picture(m, "■", "·") for t, m in transformer.masks(tokens, offset).items()}
    return dict(
        tokens=tokens,
        layers=cfg.num_hidden_layers,
        offset=offset,
        cache_length=cache_length,
        sliding_window=cfg.sliding_window if sliding else None,
        sliding_layers=sliding,
        masks=masks,
        candidates=_candidates(model, probs),
        token=int(token),
        piece=model.tokenizer.piece_for_display(int(token)) if hasattr(model, "tokenizer") else str(token),
        prob=float(probs[token]) if probs is not None else float("nan"),
    )


def decode(
    model,
    step: int,
    position: int,
    input_token: int,
    token: int,
    probs: np.ndarray | None,
    cache_length: int,
    last: bool,
    text: str,
) -> dict[str, Any]:
    """One decode step: the token fed at ``position``, the token chosen, its probability, the others."""
    tok = model.tokenizer
    return dict(
        step=step,
        position=position,
        input_token=input_token,
        input_piece=tok.piece_for_display(input_token),
        token=token,
        piece=tok.piece_for_display(token),
        prob=float(probs[token]) if probs is not None else float("nan"),
        candidates=_candidates(model, probs),
        cache_length=cache_length,
        last=last,
        text=text,
    )


def mask(model, allowed: np.ndarray, token: int, forced: list[int]) -> dict[str, Any]:
    """A constraint's mask step: how many ids the grammar allowed, the token chosen, the forced run."""
    tok = model.tokenizer
    ids = np.flatnonzero(allowed)
    return dict(
        allowed=int(ids.size),
        vocab=int(allowed.size),
        allowed_pieces=[tok.piece_for_display(int(i)) for i in ids[:8]],  # the first few, by id
        token=int(token),
        piece=tok.piece_for_display(int(token)),
        forced=[int(f) for f in forced],
        forced_pieces=[tok.piece_for_display(int(f)) for f in forced],
    )


def verify(
    model, drafted: list[int], accepted: int, token: int, bonus: bool, kept: list[int], **rates
) -> dict[str, Any]:
    """One speculative verification: the drafted pieces, how many were kept, the resampled or bonus
    token, and the rates so far (``drafted_so_far``, ``accepted_so_far``, ``tokens_per_pass``)."""
    piece, done, seen = model.tokenizer.piece_for_display, rates["accepted_so_far"], rates["drafted_so_far"]
    return dict(drafted=[piece(i) for i in drafted], accepted=accepted, token=piece(token), bonus=bonus,
                emitted=len(kept), acceptance_rate=done / seen if seen else float("nan"),
                tokens_per_pass=rates["tokens_per_pass"])  # fmt: skip


def batch_step(
    model,
    step: int,
    rows: list[dict],
    admitted: dict[int, int],
    preempted: list[int],
    finished: list[int],
    waiting: list[int],
    tables: dict[int, list[int]],
    ref_count: list[int],
    cached_free: list[int],
    blocks_used: int,
    blocks_free: int,
    blocks_total: int,
    block_size: int,
) -> dict[str, Any]:
    """One step of the batch scheduler: who ran and fed how many tokens, the pool's blocks, prefix
    hits, preemptions, and pictures of the block tables and of the pool."""
    return dict(
        step=step,
        rows=rows,
        tokens=sum(r["tokens"] for r in rows),
        admitted=admitted,
        prefix_hits={r: t for r, t in admitted.items() if t},
        preempted=preempted,
        finished=finished,
        waiting=waiting,
        cached_free=len(cached_free),
        blocks_used=blocks_used,
        blocks_free=blocks_free,
        blocks_total=blocks_total,
        block_size=block_size,
        shared_blocks=sorted({b for t in tables.values() for b in t if ref_count[b] > 1}),
        tables={int(r): t for r, t in tables.items()},
        table_picture=block_table_picture(tables, ref_count),
        pool_picture=pool_picture(ref_count, set(cached_free)),
    )


def stop(
    model,
    reason: StopReason,
    condition,
    text: str,
    ends_inside_character: bool = False,
    cache: str = "freed",
    **numbers,
) -> dict:
    """Why the request ended, in a sentence with its numbers (:func:`describe_stop`); and, when the
    last tokens are only the first bytes of a character, that the text ends in U+FFFD because of it.
    ``cache``: what the request's end did with its KV cache: ``freed`` (its own), ``emptied`` (a
    cache the caller gave), ``kept`` (a conversation's, for the next turn)."""
    tok = model.tokenizer
    eos_text = tok.decode([condition], skip_special_tokens=False) if reason is StopReason.EOS else ""
    detail = describe_stop(reason, condition, eos_ids=sorted(tok.eos_token_ids), eos_text=eos_text, **numbers)
    if ends_inside_character:
        detail += (
            "; the output ends inside a character: the last tokens hold only its first bytes, "
            "so the text ends in U+FFFD '\ufffd' (as the full decode does)"
        )
    return dict(
        reason=reason.value, condition=condition, text=text, detail=detail, new_tokens=numbers["n_new"], cache=cache
    )
