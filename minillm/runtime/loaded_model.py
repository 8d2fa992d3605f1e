"""The loaded model: what ``loading.load`` returns and every request shares (llama2.c's "weights").

A :class:`Model` holds the config, the tokenizer and the weights (in ``transformer``), and counts
what it has served; it lives across requests. ``steps.py`` runs the phases of one request on it,
``loading.py`` builds it and warms it up through those steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from minillm.errors import AdapterError
from minillm.model.config import ModelConfig
from minillm.model.lora import LoraAdapter, activate
from minillm.model.transformer import Transformer
from minillm.sources.hub import ResolvedModel
from minillm.text.tokenizer import Tokenizer


@dataclass
class Model:
    """What ``load`` returns and every request shares: config, tokenizer, weights (in ``transformer``)."""

    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    transformer: Transformer
    resolved: ResolvedModel
    load_seconds: dict[str, float] = field(default_factory=dict)  # per step, seconds
    warmup_s: float | None = None  # seconds the warm-up took; None while none has run
    requests_served: int = 0  # real requests since load (the warm-up is not counted)
    # Per-token rates of every request served, oldest first: {"prompt_tokens", "prefill_s_per_token",
    # "tpot_s"} (seconds). The diagnosis compares the first request with the later ones.
    history: list[dict] = field(default_factory=list)
    adapters: list[LoraAdapter] = field(default_factory=list)  # LoRA adapters loaded with the model
    threads: int | None = None  # BLAS threads asked for at load; None: the BLAS default (all cores)

    @property
    def load_s(self) -> float:
        """Total load time in seconds (resolve + read + layout + tokenizer + allocate)."""
        return sum(self.load_seconds.values())

    @property
    def active_adapters(self) -> list[str]:
        """Names of the LoRA adapters the forward applies (merged ones always)."""
        active = {id(d) for layer in self.transformer.weights.layers for ds in layer.lora.values() for d in ds}
        return [a.name for a in self.adapters if a.mode == "merged" or any(id(d) in active for d in a.deltas)]

    def set_active_adapters(self, names: list[str]) -> None:
        """Choose which unmerged LoRA adapters the next requests use (``[]``: the base model).

        Adapters loaded with ``merge_adapters=False`` stay beside the weights, so switching costs
        nothing; merged adapters are part of the weights and cannot be switched off.

        Raises:
            AdapterError: a name that was not loaded, or a merged adapter.
        """
        by_name = {a.name: a for a in self.adapters}
        for name in names:
            if name not in by_name:
                raise AdapterError(
                    f"no adapter named {name!r}; loaded: {sorted(by_name) or 'none'}. "
                    "Pass adapters=[path, ...] to minillm.load."
                )
        if any(a.mode == "merged" for a in self.adapters):
            raise AdapterError(
                "the adapters were merged into the weights at load; reload with "
                "merge_adapters=False to switch adapters per request."
            )
        activate([by_name[n] for n in names], self.transformer.weights)
