"""transformers' Gemma 3 answers for tests/model/test_gemma3.py, computed in a subprocess.

    python gemma3_reference.py FOLDER OUT < prompts.json

transformers' Gemma3ForCausalLM (float32, eager attention) on the same folder, asked once for everything
the parity tests compare. Its model (1 GiB of float32) and its forward over a 560-token prompt run in a
process of their own: in the test process they sat beside the session's models and minillm's Gemma, at
the suite's 3 GB budget a process (2.95 GB measured in CI; tests/support/rss_budget.py).

Written to OUT: ``answers.json`` (the first prompt's ids and 16 greedy tokens after them; for each
prompt its ids and transformers' 8 greedy tokens) and ``logits.npz`` (``logits{k}``: the logits
``[9, vocab]`` float32 of one forward over prompt ``k`` + those tokens, at the prompt's last position
and the 8 after it; ``logits_to_keep=9``, not a ``[seq, vocab]`` matrix of 585 MB).
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np


def hf_greedy(hf, ids: np.ndarray, max_new_tokens: int) -> list[int]:
    """transformers' greedy ids after ``ids`` (no EOS stop: always ``max_new_tokens``)."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor(ids[None]), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


def main(folder: Path, prompts: list[str], out: Path) -> None:
    import torch
    import transformers

    from minillm.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()  # fmt: skip
    ids = tokenizer.encode(prompts[0])
    answers, arrays = {"greedy": [ids.tolist(), hf_greedy(hf, ids, 16)], "logits": []}, {}
    for k, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        fed = ids.tolist() + hf_greedy(hf, ids, 8)
        with torch.no_grad():
            arrays[f"logits{k}"] = hf(torch.tensor([fed]), logits_to_keep=9).logits[0].numpy()  # [9, vocab]
        answers["logits"].append([ids.tolist(), fed[len(ids) :]])
    np.savez(out / "logits.npz", **arrays)
    (out / "answers.json").write_text(json.dumps(answers))


def run(folder: Path, prompts: tuple[str, ...], out: Path) -> dict:
    """Run :func:`main` in a subprocess; the answers as test_gemma3's fixture gives them: ``greedy``
    ``(ids, tokens)`` of the first prompt, ``logits[prompt]`` ``(ids, tokens, logits [9, vocab])``."""
    proc = subprocess.run([sys.executable, __file__, str(folder), str(out)], input=json.dumps(list(prompts)),
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads((out / "answers.json").read_text())
    with np.load(out / "logits.npz") as logits:
        by_prompt = {p: (*answers["logits"][k], logits[f"logits{k}"]) for k, p in enumerate(prompts)}
    return {"greedy": tuple(answers["greedy"]), "logits": by_prompt}


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.stdin.read()), Path(sys.argv[2]))
