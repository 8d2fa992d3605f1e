"""transformers' own GGUF loader, run as a script in a subprocess; prints one JSON line.

    python gguf_reference_loader.py FILE.gguf OUR_FOLDER/model.safetensors

transformers dequantizes with the same ``gguf`` package and undoes the q/k permutation itself, so
equal tensors prove our names, shapes and un-permutation. Dequantizing, its loader peaks at 2.63 GB
(Gemma 3, measured with /usr/bin/time -f %M): in a subprocess the test process need not add that to
what it already holds (the suite's 3 GB budget a process, tests/support/rss_budget.py).

Printed: ``ref_keys`` and ``ours_keys`` (sorted names), ``unequal`` ([name, our dtype, our shape,
theirs] of each tensor not float32 and bit-for-bit equal; ``lm_head.weight`` is read from our tied
embedding) and ``config`` (the shape-setting fields transformers read, ``None`` when its config class
has no such field).
"""

import ctypes
import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

FIELDS = ("layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim", "vocab_size",
          "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps",
          "rope_parameters")  # fmt: skip
CHUNK = 1 << 22  # values per comparison (Gemma 3's embedding alone is 168M): no second whole copy of a tensor


def main(gguf: Path, ours_file: str) -> dict:
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ref_sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the loader's dequantization buffers go back before we compare
    # Our file read in chunks with plain reads (an mmap would leave every page it touched in this
    # process's RSS): the safetensors layout is 8 bytes of header length, a JSON header, then the data.
    with open(ours_file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
        unequal = []
        for name, want in ref_sd.items():
            t = header["model.embed_tokens.weight" if name == "lm_head.weight" else name]
            same = t["dtype"] == "F32" and t["shape"] == list(want.shape)
            flat, begin = want.reshape(-1), 8 + n + t["data_offsets"][0]
            for start in range(0, flat.size, CHUNK) if same else ():
                f.seek(begin + 4 * start)
                got = np.fromfile(f, dtype="<f4", count=min(CHUNK, flat.size - start))
                same = same and np.array_equal(got, flat[start : start + CHUNK])
            if not same:
                unequal.append([name, t["dtype"], t["shape"], list(want.shape)])
    config = {f: getattr(ref.config, f, None) for f in FIELDS}
    return {"ref_keys": sorted(ref_sd), "ours_keys": sorted(header), "unequal": unequal, "config": config}


def run(gguf: Path, ours_file: Path) -> dict:
    """Run this script in a subprocess on ``gguf`` and our converted ``ours_file``; its printed JSON."""
    import os
    import subprocess

    # A fixed mmap threshold (glibc, mallopt(3)): every buffer over 1 MiB is its own mapping, returned
    # when freed. With glibc's sliding threshold a freed 671 MB dequantized embedding sometimes stayed
    # in the heap: the loader peaked at 3.28 GB in 1 of 3 runs, 2.63 GB in 3 of 3 with the fixed one.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run([sys.executable, __file__, str(gguf), str(ours_file)], capture_output=True,
                          text=True, timeout=900, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2])))
