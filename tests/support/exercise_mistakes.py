"""Typical wrong implementations a student writes, one or more per unit, each a whole student file.

``MISTAKES``: (unit, what is wrong, the file's source, a phrase the failure's hint must hold, or None
where no hint is listed for that mistake: then the failure's message must hold the phrase instead).
"""

NP = "import numpy as np\n\n"

KV_CACHE = (
    NP
    + """
class KVCache:
    def __init__(self, num_layers, num_kv_heads, head_dim, max_seq_len, dtype="float32"):
        self.k = np.zeros((num_layers, num_kv_heads, max_seq_len, head_dim), np.float32)
        self.v = np.zeros_like(self.k)
        self.length = 0

    def write(self, layer, k, v):
        end = self.length + k.shape[1]
        self.k[layer, :, self.length:end], self.v[layer, :, self.length:end] = k, v
        return {returned}

    def read(self, layer, end):
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def advance(self, seq):
        {advance}

    def truncate(self, length):
        self.length = length
"""
)

ATTENTION = (
    NP
    + """
def attention(q, k, v, mask, scale):
    group = q.shape[0] // k.shape[0]
    k, v = {repeated}
    s = q @ k.transpose(0, 2, 1){scaled} + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
    return (p @ v).astype(np.float32), p
"""
)

DETOKENIZER = (
    NP
    + """
class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens=True, prompt_ids=None):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def add(self, token_id):
        self.ids.append(int(token_id))
{add}

    def flush(self):
        return ""
"""
)

MISTAKES = [
    (
        "causal_mask",
        "the diagonal masked",
        NP
        + """
def causal_mask(seq, ctx, offset=0):
    q = offset + np.arange(seq)[:, None]
    k = np.arange(ctx)[None, :]
    return np.where(k < q, 0.0, -np.inf).astype(np.float32)
""",
        "diagonal",
    ),
    (
        "causal_mask",
        "the offset ignored",
        NP
        + """
def causal_mask(seq, ctx, offset=0):
    q = np.arange(seq)[:, None]
    k = np.arange(ctx)[None, :]
    return np.where(k <= q, 0.0, -np.inf).astype(np.float32)
""",
        "offset ignored",
    ),
    (
        "causal_mask",
        "a square mask of the context",
        NP
        + """
def causal_mask(seq, ctx, offset=0):
    return np.triu(np.full((ctx, ctx), -np.inf, dtype=np.float32), 1)
""",
        None,
    ),
    (
        "sliding_window_mask",
        "one key too many at the window's edge",
        NP
        + """
def sliding_window_mask(seq, ctx, offset=0, window=4096):
    q = offset + np.arange(seq)[:, None]
    k = np.arange(ctx)[None, :]
    return np.where((k <= q) & (k >= q - window), 0.0, -np.inf).astype(np.float32)
""",
        "window's edge",
    ),
    (
        "softmax",
        "no maximum subtracted",
        NP
        + """
def softmax(x, axis=-1, *, out=None):
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)
""",
        "no maximum subtracted",
    ),
    (
        "softmax",
        "normalized along axis 0 always",
        NP
        + """
def softmax(x, axis=-1, *, out=None):
    e = np.exp(x - x.max(axis=0, keepdims=True))
    return e / e.sum(axis=0, keepdims=True)
""",
        "wrong axis",
    ),
    (
        "softmax",
        "float64 out",
        NP
        + """
def softmax(x, axis=-1, *, out=None):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
""",
        None,
    ),
    (
        "rms_norm",
        "eps added after the square root",
        NP
        + """
def rms_norm(x, weight, eps):
    return x / (np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) + eps) * weight
""",
        "eps added after",
    ),
    (
        "rms_norm",
        "the mean subtracted (LayerNorm)",
        NP
        + """
def rms_norm(x, weight, eps):
    c = x - x.mean(axis=-1, keepdims=True)
    return c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps) * weight
""",
        "mean subtracted",
    ),
    (
        "apply_rope",
        "halves paired as interleaved pairs",
        NP
        + """
def rotate_half(x):
    out = np.empty_like(x)
    out[..., 0::2] = -x[..., 1::2]
    out[..., 1::2] = x[..., 0::2]
    return out


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin
""",
        "interleaved",
    ),
    (
        "apply_rope",
        "rotate_half's sign flipped",
        NP
        + """
def rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([x[..., half:], -x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin
""",
        "[-x2, x1]",
    ),
    (
        "attention",
        "kv heads repeated with np.tile",
        ATTENTION.format(repeated="np.tile(k, (group, 1, 1)), np.tile(v, (group, 1, 1))", scaled=" * scale"),
        "wrong order",
    ),
    (
        "attention",
        "no scale",
        ATTENTION.format(repeated="np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)", scaled=""),
        "scale",
    ),
    (
        "silu",
        "sigmoid alone",
        NP
        + """
def silu(x):
    return (1 / (1 + np.exp(-x))).astype(np.float32)
""",
        "sigmoid",
    ),
    (
        "KVCache",
        "a cache that does not advance",
        KV_CACHE.format(returned="self.k[layer, :, :end], self.v[layer, :, :end]", advance="pass"),
        "does not advance",
    ),
    (
        "KVCache",
        "write returns this call's keys only",
        KV_CACHE.format(returned="k, v", advance="self.length += seq"),
        "every filled position",
    ),
    (
        "apply_temperature",
        "multiplied by the temperature",
        NP
        + """
def apply_temperature(logits, temperature):
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    return (np.asarray(logits, np.float32) * np.float32(temperature)).astype(np.float32)
""",
        "divide",
    ),
    (
        "apply_top_k",
        "ties with the k-th dropped (rank, not value)",
        NP
        + """
def apply_top_k(logits, k):
    out = np.array(logits, dtype=np.float32)
    if k <= 0 or k >= out.size:
        return out
    out[np.argsort(-out, kind="stable")[k:]] = -np.inf
    return out
""",
        "ties",
    ),
    (
        "apply_top_p",
        "the token that crosses p dropped",
        NP
        + """
def apply_top_p(logits, p):
    out = np.array(logits, dtype=np.float32)
    if p >= 1.0:
        return out
    probs = np.exp(out - out.max()); probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.cumsum(probs[order]) < p
    keep[0] = True
    out[order[~keep]] = -np.inf
    return out
""",
        "crosses p",
    ),
    (
        "apply_min_p",
        "an absolute threshold",
        NP
        + """
def apply_min_p(logits, min_p):
    out = np.array(logits, dtype=np.float32)
    if min_p <= 0:
        return out
    probs = np.exp(out - out.max()); probs /= probs.sum()
    out[probs < min_p] = -np.inf
    return out
""",
        "relative",
    ),
    (
        "apply_repetition_penalty",
        "a negative logit divided",
        NP
        + """
def apply_repetition_penalty(logits, seen_ids, penalty):
    out = np.array(logits, dtype=np.float32)
    ids = np.unique(np.asarray(list(seen_ids), dtype=np.int64))
    out[ids] = out[ids] / np.float32(penalty)
    return out
""",
        "negative logit",
    ),
    (
        "apply_repetition_penalty",
        "an id penalised once per occurrence",
        NP
        + """
def apply_repetition_penalty(logits, seen_ids, penalty):
    out = np.array(logits, dtype=np.float32)
    for i in seen_ids:
        out[i] = out[i] / np.float32(penalty) if out[i] > 0 else out[i] * np.float32(penalty)
    return out
""",
        "penalised once",
    ),
    (
        "IncrementalDetokenizer",
        "each id decoded alone",
        DETOKENIZER.format(add="        return self.tokenizer.decode([token_id])"),
        "UTF-8 character",
    ),
    (
        "IncrementalDetokenizer",
        "flush forgets the held-back text",
        DETOKENIZER.format(
            add="""        text = self.tokenizer.decode(self.ids)
        if text.endswith("\\ufffd"):
            return ""
        delta, self.shown = text[len(self.shown):], text
        return delta"""
        ),
        None,
    ),
    (
        "IncrementalDetokenizer",
        "half characters shown (nothing held back)",
        DETOKENIZER.format(
            add="""        text = self.tokenizer.decode(self.ids)
        delta, self.shown = text[len(self.shown):], text
        return delta"""
        ),
        "UTF-8 character",
    ),
    (
        "blocks_for",
        "floor instead of ceil",
        NP
        + """
def blocks_for(positions, block_size):
    return positions // block_size
""",
        "ceil",
    ),
    (
        "slots",
        "the table not looked up",
        NP
        + """
def slots(table, positions, block_size):
    return np.asarray(positions, dtype=np.int64)
""",
        "table",
    ),
    (
        "block_hashes",
        "hashes not chained",
        NP
        + """
import hashlib


def block_hashes(token_ids, block_size, n_blocks=None, identity=b""):
    n = len(token_ids) // block_size if n_blocks is None else n_blocks
    ids = np.asarray(token_ids[: n * block_size], dtype=np.int64)
    return [hashlib.blake2b(identity + ids[j * block_size:(j + 1) * block_size].tobytes(), digest_size=16).digest()
            for j in range(n)]
""",
        "chain",
    ),
    (
        "acceptance_probability",
        "p / q without the min",
        NP
        + """
def acceptance_probability(p, q, x):
    if q is None:
        return float(p[x])
    return float(p[x] / q[x]) if q[x] > 0 else 1.0
""",
        "min(1",
    ),
    (
        "residual",
        "not normalized",
        NP
        + """
def residual(p, q, x):
    q = np.eye(1, len(p), x)[0] if q is None else q
    return np.maximum(np.asarray(p, dtype=np.float64) - q, 0.0)
""",
        "normalize",
    ),
]

#: For the mistakes with no listed hint: a phrase the failure's message holds (what it says is wrong).
MESSAGE_PHRASES = {
    "a square mask of the context": "shape",
    "float64 out": "dtype",
    "flush forgets the held-back text": "the whole stream",
}
