"""Nothing from a model folder runs: pickle weights are refused unopened, code files and auto_map are ignored,
shard indexes and manifest paths cannot leave the model folder.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from broken_folders import load, shard
from tiny_models import save

import minillm
from minillm.errors import ManifestError, WeightsError

ROOT = Path(__file__).resolve().parents[2]


class _Evil:
    """Unpickling this would create the file named in SENTINEL: proof that a pickle ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickle_weights_are_refused_and_never_opened(folder, no_forward, name):
    sentinel = folder.parent / "unpickled"
    (folder / "model.safetensors").unlink()
    (folder / name).write_bytes(pickle.dumps(_Evil(str(sentinel))))
    with pytest.raises(WeightsError, match=rf"has only pickle weights \({name}\); minillm never unpickles \(it can "
                                           r"run code\)\. Convert them to safetensors or download the safetensors"):
        load(folder)
    assert not sentinel.exists()


def test_code_in_a_model_folder_never_runs(folder):
    sentinel = folder.parent / "code-ran"
    code = f"open({str(sentinel)!r}, 'w').write('pwned')\n"
    (folder / "modeling_evil.py").write_text(code)
    (folder / "tokenization_evil.py").write_text(code)
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Evil(str(sentinel))))  # next to safetensors: ignored
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    minillm.generate(load(folder), "AB", max_new_tokens=2)
    assert not sentinel.exists()


def test_the_source_never_runs_remote_code_or_unpickles():
    source = "\n".join(p.read_text() for p in (ROOT / "minillm").rglob("*.py"))
    for forbidden in ("trust_remote_code=True", "import pickle", "torch.load", "exec(", "eval(", "jinja2.Environment("):
        assert forbidden not in source, forbidden
    assert "ImmutableSandboxedEnvironment(" in source


@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../outside.safetensors"])
def test_a_shard_index_cannot_escape_the_model_folder(folder, no_forward, name):
    shard(folder, {"model-00002-of-00002.safetensors": name})
    save({"x": np.zeros(1, np.float32)}, folder.parent / "outside.safetensors")  # there, but never read
    with pytest.raises(WeightsError, match=rf"names shard '{re.escape(name)}', a path outside the model folder .*; "
                                           "refusing to read it"):
        load(folder)


@pytest.mark.parametrize("path", ["../../evil.py", "/etc/passwd", "sub/../../x.json", "~/.bashrc"])
def test_manifest_paths_cannot_escape_the_model_folder(tmp_path, path):
    manifest = tmp_path / "manifest.toml"
    manifest.write_text(f'''
[models.tiny]
family = "llama"
license = "mit"
[models.tiny.hub]
repo = "org/tiny"
files = ["config.json", "{path}"]
''')
    with pytest.raises(ManifestError, match=rf"models.tiny.hub.files lists '{re.escape(path)}', which is not a plain "
                                            r"path inside the model folder \(no absolute paths, no '\.\.'\)"):
        minillm.sources.manifest.load_manifest(manifest)
