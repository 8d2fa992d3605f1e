"""A GGUF file minillm cannot convert (minillm/sources/gguf_import.py) is refused with the reason and leaves no
half-written folder. SEE tests/sources/test_gguf_import.py for the same cases on a full tiny llama GGUF.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from minillm.errors import GGUFError


def tiny_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray] = {}) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, t in tensors.items():  # an array, or (packed bytes, its GGML type)
        w.add_tensor(name, t[0], raw_dtype=t[1]) if isinstance(t, tuple) else w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_bad_magic(tmp_path):
    from minillm.sources.gguf_import import import_gguf

    file = tiny_gguf(tmp_path / "m.gguf", "llama")
    file.write_bytes(b"<htm" + file.read_bytes()[4:])  # what a saved error page starts with
    with pytest.raises(GGUFError, match=r"m.gguf is not a GGUF file: it starts with b'<htm', not b'GGUF'; pass a "
                                        r".gguf file \(a partial download or an HTML error page looks like this\)"):
        import_gguf(file, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_gguf_architecture_not_converted(tmp_path):
    from minillm.sources.gguf_import import import_gguf

    file = tiny_gguf(tmp_path / "m.gguf", "mamba")
    with pytest.raises(GGUFError, match=r"m.gguf: architecture 'mamba' is not supported \(supported: "
                                        r"\['gemma3', 'llama'\]\); pick a GGUF of a supported family"):
        import_gguf(file, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_gguf_quantization_type_not_read(tmp_path):
    import gguf

    from minillm.sources.gguf_import import import_gguf

    # gguf.quants cannot dequantize Q8_1 (one block: 32 values in 40 bytes): it stands in for any such
    # type (integer tensors are read as plain numbers, see test_gguf_import.py's byte-order tests)
    packed = (np.zeros((1, 40), np.uint8), gguf.GGMLQuantizationType.Q8_1)
    file = tiny_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": packed})
    with pytest.raises(GGUFError, match=r"m.gguf: tensor token_embd.weight \(1 tensor\(s\)\) has type Q8_1, which "
                                        "gguf.quants cannot dequantize; use a GGUF quantized as"):
        import_gguf(file, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
