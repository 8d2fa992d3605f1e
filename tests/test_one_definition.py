"""One concept, one table (issue 42): the KV-cache dtypes, a position's KV bytes and the BLAS's
thread count are each defined once in minillm/, and every other place imports that definition.

Before issue 42, ``KV_DTYPES`` stood in three modules with two meanings (NumPy dtypes; bytes per
value and scale), ``kv_bytes_per_token`` was defined three times and ``blas_threads`` twice, the
two answering differently with no BLAS (None and 1).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minillm"
ONCE = ("KV_DTYPES", "kv_bytes_per_token", "blas_threads")


def definitions(name: str) -> list[str]:
    """``path:line`` of every function, method or module-level assignment named ``name`` in minillm/."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            defined = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
            if isinstance(node, ast.Assign) and node in tree.body:
                defined = any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            if defined:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_each_table_and_formula_is_defined_once():
    assert {name: len(definitions(name)) for name in ONCE} == dict.fromkeys(ONCE, 1), {n: definitions(n) for n in ONCE}


def test_the_one_kv_table_gives_every_size():
    from minillm.model.config import KV_DTYPES, ModelConfig
    from minillm.model.kv_cache import KVCache
    from minillm.observe.metrics import kv_memory_table

    config = ModelConfig(
        model_type="llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        vocab_size=10,
        max_position_embeddings=8,
    )
    assert KV_DTYPES == {"float32": (4, 0), "float16": (2, 0), "int8": (1, 4)}
    # 2 (k, v) x 2 layers x 2 kv heads x (head_dim 4 x bytes per value + scale bytes)
    expected = {"float32": 2 * 2 * 2 * 16, "float16": 2 * 2 * 2 * 8, "int8": 2 * 2 * 2 * (4 + 4)}
    assert {d: config.kv_bytes_per_token(d) for d in KV_DTYPES} == expected
    assert {d: KVCache.for_model(config, max_seq_len=3, dtype=d).bytes_per_token for d in KV_DTYPES} == expected
    assert kv_memory_table(config) == {d: (n, 8 * n) for d, n in expected.items()}
