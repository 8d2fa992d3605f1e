"""A scripted "model" for lifecycle tests: a real Tokenizer and KVCache, and a transformer whose
logits make a given id sequence the greedy choice. Every stop condition can then be tested with
exact expected values, in milliseconds."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from minillm.model.config import ModelConfig
from minillm.model.kernels import PLAIN
from minillm.model.positions import PositionTables
from minillm.model.transformer import Transformer
from minillm.runtime.loading import Model
from minillm.text.tokenizer import Tokenizer

PIECES = ["AB", "C", "DEF", "G", "HI", "J", "KL", "X", "DE", "Y", "Z", "w", "<start_of_turn>", "user", "model"]
EOT = 106  # '<end_of_turn>' (Gemma 3's second EOS id); a plain vocabulary entry here, not special
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn> {{ m['role'] }} {{ m['content'] }} "
            "<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}")


def word_tokenizer_folder(path: Path) -> Path:
    """Whole-word vocabulary, decoded by concatenation (Fuse): pieces 'AB','C' decode to 'ABC'.

    ids: 0 <pad>, 1 <eos>, 2 <bos>, 3.. PIECES, fillers, 106 <end_of_turn>. Encoding prepends
    <bos> (a post-processor, like Llama 3 / Gemma). generation_config gives eos_token_id [1, 106].
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for p in PIECES:
        vocab[p] = len(vocab)
    while len(vocab) < EOT:
        vocab[f"f{len(vocab)}"] = len(vocab)
    vocab["<end_of_turn>"] = EOT
    vocab["<unk>"] = EOT + 1
    backend = Backend(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, EOT]}))
    return path


class ScriptedTransformer:
    """Stands in for ``minillm.model.transformer.Transformer``: writes nothing but advances the cache like the
    real one, and returns logits whose argmax is the next id of ``script`` (then ``filler``).

    ``logits`` (a ``[vocab]`` array) replaces the one-hot scores when given; ``delay_s`` makes each
    forward pass that slow; ``interrupt_at`` raises KeyboardInterrupt on that forward call
    (0 = prefill), as Ctrl-C would.
    """

    def __init__(self, config: ModelConfig, script: list[int], filler: int = 3, logits=None,
                 delay_s: float = 0.0, interrupt_at: int | None = None):
        self.config = config
        self.script = list(script)
        self.filler = filler
        self.logits = logits
        self.delay_s = delay_s
        self.interrupt_at = interrupt_at
        self.calls = 0  # forward calls in the current request
        self.weights = SimpleNamespace(num_parameters=0, nbytes=0)  # no real weights: the memory table shows 0
        self.positions = PositionTables(config)  # as Transformer: its masks are the real ones
        self.layer_types = self.positions.layer_types
        self.fed: list[list[int]] = []  # what each forward call was given

    masks = Transformer.masks  # the real masks, from config and layer_types (the trace draws them)
    kernels = PLAIN  # what the trace's load section and the prefix cache's identity name

    def forward(self, token_ids, cache=None, *, last_only: bool = False, capture=None) -> np.ndarray:
        token_ids = np.asarray(token_ids, dtype=np.int64)
        if cache is not None:
            if cache.length == 0:  # a new request starts with prefill at position 0
                self.calls, self.fed = 0, []
            cache.check_room(len(token_ids))
            cache.advance(len(token_ids))
        if self.interrupt_at is not None and self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        if self.delay_s:
            time.sleep(self.delay_s)
        self.fed.append(token_ids.tolist())
        step = self.calls
        self.calls += 1
        if self.logits is not None:
            row = np.asarray(self.logits, dtype=np.float32)
        else:
            row = np.full(self.config.vocab_size, -10.0, dtype=np.float32)
            row[self.script[step] if step < len(self.script) else self.filler] = 10.0
        rows = 1 if last_only else len(token_ids)
        return np.tile(row, (rows, 1))  # [seq, vocab]


def scripted_model(tokenizer: Tokenizer, script: list[int], *, context: int = 256, **kwargs) -> Model:
    """A :class:`minillm.runtime.loading.Model` around :class:`ScriptedTransformer`."""
    config = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": tokenizer.vocab_size, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
        "max_position_embeddings": context,
    })
    return Model("scripted", Path("."), config, tokenizer, ScriptedTransformer(config, script, **kwargs), None)


def ids_of(tokenizer: Tokenizer, *pieces: str) -> list[int]:
    """Vocabulary ids of whole pieces, e.g. ids_of(tok, 'AB', 'C') -> [3, 4]."""
    out = [tokenizer.backend.token_to_id(p) for p in pieces]
    assert None not in out, pieces
    return out


class ChainTransformer:
    """A batched stand-in for the scheduler (``forward_batch``): the next id depends only on the
    last id fed, ``chain[last]`` (else ``filler``), so requests batched, chunked or preempted
    all get the same answer. Writes nothing; advances each sequence like the real one."""

    masks = Transformer.masks
    kernels = PLAIN  # what the prefix cache's identity names

    def __init__(self, config: ModelConfig, chain: dict[int, int], filler: int):
        self.config, self.chain, self.filler = config, dict(chain), filler
        self.weights = SimpleNamespace(num_parameters=0, nbytes=0, layers=[], weight_dtype="float32")  # kv_identity reads these
        self.layer_types = [config.layer_type(i) for i in range(config.num_hidden_layers)]
        self.positions = PositionTables(config)  # what Transformer.masks reads (the trace draws them)

    def forward_batch(self, chunks, *, all_logits: bool = False, last_rows=None) -> np.ndarray:
        rows = []
        for j, (ids, seq) in enumerate(chunks):
            seq.check_room(len(ids))
            seq.advance(len(ids))
            for i in ids[len(ids) - (1 if last_rows is None else last_rows[j]) :]:  # the rows asked for
                row = np.full(self.config.vocab_size, -10.0, dtype=np.float32)
                row[self.chain.get(int(i), self.filler)] = 10.0
                rows.append(row)
        return np.stack(rows)  # [rows asked for, vocab]: each one's last row (or last_rows[j] rows)


def chain_model(tokenizer: Tokenizer, pieces: list[str], end: int | None = None, *, filler: str = "w",
                context: int = 256) -> Model:
    """A Model whose greedy answer after ``pieces[0]`` is ``pieces[1:]``, then ``end`` (an id, e.g.
    an EOS), then ``filler`` forever."""
    ids = ids_of(tokenizer, *pieces, filler)
    chain = dict(zip(ids[:-2], ids[1:-1], strict=True))
    if end is not None:
        chain[ids[-2]] = end
    model = scripted_model(tokenizer, [], context=context)
    model.transformer = ChainTransformer(model.config, chain, ids[-1])
    return model
