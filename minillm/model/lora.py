"""LoRA adapters (Hu et al. 2021) in PEFT's format: read, check, then merge or keep apart.

A LoRA adapter changes a frozen projection ``W`` by a low-rank product. PEFT writes it as two small
``nn.Linear`` weights per targeted module: ``A`` ``[r, in]`` and ``B`` ``[out, r]``, with
``scaling = lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``). minillm stores weights in HF's
``[out, in]`` layout too, so::

    W' = W + scaling * B @ A                                  # [out, r] @ [r, in] -> [out, in]
    y  = x @ W'.T = x @ W.T + scaling * (x @ A.T) @ B.T       # the same, never forming the product

Two ways to run it, chosen at load (``minillm.load(..., adapters=[path], merge_adapters=...)``):

- **merged**: add ``scaling * B @ A`` into ``W`` once. Zero cost per token; the base weights are
  gone, so the adapter cannot be switched off.
- **unmerged**: keep ``A`` and ``B`` beside ``W``; ``LayerWeights.project`` adds the low-rank path in
  the forward, ``(x @ A.T) @ B.T``: two thin matrix products per projection. Costs a little per
  token, and ``Model.set_active_adapters`` switches adapters per request.

minillm fuses q|k|v into ``w_qkv`` and gate|up into ``w_gate_up``, so a ``q_proj`` adapter adds to
the first ``q_dim`` rows (outputs) of ``w_qkv``, a ``v_proj`` adapter to the last ``kv_dim``: each
:class:`LoraDelta` carries its row slice. GPT-2's ``c_attn`` is already fused, so its adapter
spans all of ``w_qkv``. PEFT saves ``A`` and ``B`` as ``nn.Linear`` weights even for GPT-2's
``Conv1D`` modules (``fan_in_fan_out=True`` only tells PEFT to transpose the product when it
merges into a Conv1D ``[in, out]`` weight), and minillm's weights are ``[out, in]`` for every family
(``weights.py`` transposes Conv1D at load), so the formula above holds for both settings.

Supported: ``peft_type: LORA`` on the attention and MLP projections, any rank (also per module via
``rank_pattern``), rsLoRA. Refused with :class:`~minillm.errors.AdapterError`: DoRA, other adapter
types, adapters on embeddings or the head, trained biases, ``alpha_pattern``, ``modules_to_save``
with tensors in the file, and the other PEFT variants listed in :data:`_REFUSED`.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from minillm.errors import AdapterError, WeightsError
from minillm.model.config import ModelConfig
from minillm.model.families import NAME_MAPS, OPTIONAL_PREFIX, MlpKind
from minillm.model.weights import Weights
from minillm.sources.json_file import read_json
from minillm.sources.safetensors_file import read_safetensors_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's wrapper around the HF model, in every saved name

# Config fields of PEFT variants minillm does not run: a truthy value is refused, with the reason.
_REFUSED = {
    "use_dora": "DoRA (weight-decomposed LoRA) rescales each column of W' by a learned magnitude",
    "use_qalora": "QA-LoRA pools the input in groups before A",
    "use_bdlora": "BD-LoRA uses block-diagonal factors",
    "lora_bias": "the adapter trains a bias for B",
    "alpha_pattern": "alpha_pattern gives some modules their own lora_alpha",
    "layer_replication": "layer_replication duplicates decoder layers",
    "target_parameters": "target_parameters adapts raw parameters, not modules",
    "trainable_token_indices": "trainable_token_indices changes rows of the embedding",
    "alora_invocation_tokens": "activated LoRA switches on at invocation tokens",
    "megatron_config": "Megatron-parallel layers",
}


@dataclass
class LoraDelta:
    """One module's low-rank update, as PEFT stores it.

    ``a`` ``[r, in]`` is PEFT's ``A``, ``b`` ``[rows, r]`` its ``B``; it adds ``scaling * b @ a`` to
    rows ``rows`` (the module's outputs) of the fused projection ``weight`` ``[out, in]``.
    """

    module: str  # PEFT's module name, e.g. "model.layers.3.self_attn.q_proj"
    layer: int
    weight: str  # LayerWeights field: "w_qkv", "w_o", "w_gate_up", "w_up", "w_down"
    rows: slice  # rows (outputs) of that weight this module owns (q, k or v of w_qkv; gate or up)
    a: np.ndarray  # [r, in]
    b: np.ndarray  # [rows, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The low-rank path of the unmerged adapter: ``scaling * (x @ A.T) @ B.T``, ``[seq, in]`` ->
        ``[seq, rows]``; two thin products, never the ``[rows, in]`` product ``B A``."""
        return np.float32(self.scaling) * ((x @ self.a.T) @ self.b.T)  # [seq, r] @ [r, rows]

    def product(self) -> np.ndarray:
        """``scaling * B @ A``: ``[rows, in]``, what merging adds to ``weight[rows]``."""
        return np.float32(self.scaling) * (self.b @ self.a)


@dataclass
class LoraAdapter:
    """A PEFT LoRA adapter read from a folder, checked against one model, ready to merge or run."""

    name: str
    path: Path
    rank: int  # the config's r (a module's own rank is ``delta.rank``)
    alpha: float
    use_rslora: bool
    scaling: float  # alpha / r, or alpha / sqrt(r) with rsLoRA
    targets: list[str]  # module kinds, e.g. ["q_proj", "v_proj"]
    deltas: list[LoraDelta]
    base_model: str | None  # adapter_config.json's base_model_name_or_path
    fan_in_fan_out: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    mode: str = "unmerged"  # "merged" once merge() ran

    @property
    def num_parameters(self) -> int:
        return sum(delta.a.size + delta.b.size for delta in self.deltas)

    @property
    def nbytes(self) -> int:
        return sum(delta.a.nbytes + delta.b.nbytes for delta in self.deltas)

    def summary(self) -> dict:
        """The trace's view of the adapter (plain data)."""
        return {
            "name": self.name,
            "path": str(self.path),
            "rank": self.rank,
            "alpha": self.alpha,
            "rslora": self.use_rslora,
            "scaling": self.scaling,
            "targets": self.targets,
            "layers": len({delta.layer for delta in self.deltas}),
            "modules": len(self.deltas),
            "parameters": self.num_parameters,
            "bytes": self.nbytes,
            "mode": self.mode,
            "base_model": self.base_model,
            "seconds": self.seconds,
            "notes": list(self.notes),
        }


# --- where each PEFT module lands in minillm's layout -------------------------------------------------
def module_slots(config: ModelConfig) -> dict[str, tuple[int, str, slice]]:
    """PEFT module name (without ``base_model.model.``) -> (layer, LayerWeights field, row slice).

    Built from the family's HF name map in ``weights.py``: ``model.layers.{i}.self_attn.k_proj``
    -> ``(i, "w_qkv", slice(q_dim, q_dim + kv_dim))``. GPT-2 names are listed with and without
    their optional ``transformer.`` prefix.
    """
    names = NAME_MAPS[config.family]
    q, kv, ffn, d_model = config.q_dim, config.kv_dim, config.intermediate_size, config.hidden_size
    gated = config.mlp is MlpKind.GATED
    where = {
        "q": ("w_qkv", slice(0, q)),
        "k": ("w_qkv", slice(q, q + kv)),
        "v": ("w_qkv", slice(q + kv, q + 2 * kv)),
        "qkv": ("w_qkv", slice(0, q + 2 * kv)),
        "o": ("w_o", slice(0, d_model)),
        "gate": ("w_gate_up", slice(0, ffn)),
        "up": ("w_gate_up", slice(ffn, 2 * ffn)) if gated else ("w_up", slice(0, ffn)),
        "down": ("w_down", slice(0, d_model)),
    }
    prefix = OPTIONAL_PREFIX.get(config.family)
    slots = {}
    for key, (weight, rows) in where.items():
        if key not in names:
            continue
        for i in range(config.num_hidden_layers):
            module = names[key].format(i=i).removesuffix(".weight")
            slots[module] = (i, weight, rows)
            if prefix and module.startswith(prefix):
                slots[module[len(prefix) :]] = (i, weight, rows)
    return slots


# --- reading -------------------------------------------------------------------------------------------
def read_adapter_config(folder: Path) -> dict:
    """``adapter_config.json`` as a dict, after refusing what minillm does not run."""
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(
            f"adapter folder {folder} does not exist; pass the folder PEFT's "
            "save_pretrained wrote (adapter_config.json + adapter_model.safetensors)."
        )
    missing = (
        f"{file} is missing; a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE} "
        "(save it with PeftModel.save_pretrained)."
    )
    cfg = read_json(file, AdapterError, missing=missing, fix="re-save the adapter.")
    if not isinstance(cfg, dict):
        raise AdapterError(f"{file}: expected a JSON object of fields, got {type(cfg).__name__}; re-save the adapter.")
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise AdapterError(f"{file}: peft_type is {kind!r}; minillm runs LoRA adapters only (peft_type 'LORA').")
    for key, what in _REFUSED.items():
        if cfg.get(key):
            raise AdapterError(
                f"{file}: {key} is set ({what}); minillm runs plain LoRA only. "
                f"Retrain without {key}, or merge the adapter with PEFT (merge_and_unload) "
                "and load the merged model."
            )
    if cfg.get("bias", "none") != "none":
        raise AdapterError(
            f"{file}: bias is {cfg['bias']!r}: the adapter trains biases, which minillm does not "
            "apply; use bias='none', or merge it with PEFT and load the merged model."
        )
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise AdapterError(f"{file}: {key} must be a positive number, got {cfg.get(key)!r}.")
    return cfg


def check_adapter_folder(path: str | os.PathLike) -> tuple[dict, Path]:
    """The folder's checked ``adapter_config.json`` (a dict) and its weights file's path, no tensor
    read: what a server or a deployment checks before it loads anything.

    Raises:
        AdapterError: no such folder, no ``adapter_config.json`` or ``adapter_model.safetensors``,
            or a config minillm does not run (as :func:`load_adapter`, which calls this first).
    """
    folder = Path(path).expanduser()
    cfg = read_adapter_config(folder)
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        old = (folder / "adapter_model.bin").is_file()
        hint = " (only adapter_model.bin, the pickle format: re-save with safe_serialization=True)" if old else ""
        raise AdapterError(f"{file} is missing{hint}; save the adapter with PeftModel.save_pretrained.")
    return cfg, file


def load_adapter(
    path: str | os.PathLike, config: ModelConfig, weights: Weights, *, model_names: tuple[str, ...] = ()
) -> LoraAdapter:
    """Read a PEFT LoRA folder and check every tensor against the loaded model.

    Args:
        path: the folder PEFT's ``save_pretrained`` wrote.
        config, weights: the loaded base model the adapter must fit.
        model_names: names the base model goes by (manifest name, folder, hub repo); when the
            adapter's ``base_model_name_or_path`` matches none, a note says so (not an error:
            local folders have other names, and the shapes are checked anyway).

    Raises:
        AdapterError: missing files, an unsupported variant (DoRA, other peft_type, ...), a
            tensor for a module minillm cannot adapt, an A without its B, or a tensor whose shape
            does not fit the model (the message names the first such tensor).
    """
    t0 = time.perf_counter()
    folder = Path(path).expanduser()
    cfg, file = check_adapter_folder(folder)
    try:
        tensors = read_safetensors_header(file)
    except WeightsError as exc:
        raise AdapterError(f"{file}: {exc}") from None

    r, alpha, rslora = int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg.get("use_rslora"))
    rank_pattern = cfg.get("rank_pattern") or {}

    def scaling_for(rank: int) -> float:
        return alpha / math.sqrt(rank) if rslora else alpha / rank

    slots = module_slots(config)
    pairs = _pair_tensors(file, tensors, slots, config)
    deltas = [
        _delta(file, module, ab, slots[module], weights, tensors, _pattern_rank(module, rank_pattern, r), scaling_for)
        for module, ab in pairs.items()
    ]
    if not deltas:
        raise AdapterError(f"{file} holds no LoRA tensors; nothing to apply.")
    deltas.sort(key=lambda delta: (delta.layer, delta.weight, delta.rows.start))
    adapter = LoraAdapter(
        name=folder.resolve().name,
        path=folder,
        rank=r,
        alpha=alpha,
        use_rslora=rslora,
        scaling=scaling_for(r),
        targets=sorted({delta.module.rsplit(".", 1)[-1] for delta in deltas}),
        deltas=deltas,
        base_model=cfg.get("base_model_name_or_path"),
        fan_in_fan_out=bool(cfg.get("fan_in_fan_out")),
    )
    adapter.notes += _base_model_notes(adapter, model_names)
    adapter.seconds = time.perf_counter() - t0
    return adapter


def _pair_tensors(file: Path, tensors: dict, slots: dict, config: ModelConfig) -> dict[str, dict[str, str]]:
    """``module -> {"A": tensor name, "B": tensor name}`` for every tensor of the adapter file, in name order.

    Raises AdapterError: a tensor that replaces a whole module, one that is not a LoRA A/B weight,
    one for a module the model does not have as an attention or MLP projection.
    """
    pairs: dict[str, dict[str, str]] = {}
    for name in sorted(tensors):
        module, _, part = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            if ".modules_to_save." in name or name.removeprefix(PEFT_PREFIX) in _full_names(config):
                raise AdapterError(
                    f"{file}: tensor {name!r} replaces a whole module (modules_to_save); minillm "
                    "applies low-rank updates only. Merge the adapter with PEFT "
                    "(merge_and_unload) and load the merged model."
                )
            raise AdapterError(
                f"{file}: tensor {name!r} is not a LoRA A/B weight (lora_embedding_*, magnitude "
                "vectors and biases are not supported)."
            )
        if module not in slots:
            raise AdapterError(
                f"{file}: tensor {name!r} adapts module {module!r}, which a {config.model_type} "
                "model with this config.json does not have as an attention or MLP projection "
                "(minillm adapts q/k/v/o and the MLP projections only)."
            )
        pairs.setdefault(module, {})[part[0]] = name
    return pairs


def _delta(
    file: Path, module: str, ab: dict, slot: tuple, weights: Weights, tensors: dict, expected_rank: int, scaling_for
) -> LoraDelta:
    """One module's :class:`LoraDelta`: its A ``[r, in]`` and B ``[rows, r]`` read as float32 after
    their shapes are checked against the model's matrix (``slot``: layer, fused weight, rows).

    Raises AdapterError: an A without its B (or the reverse), a shape that does not fit, unreadable data.
    """
    if set(ab) != {"A", "B"}:
        have = next(iter(ab.values()))
        raise AdapterError(
            f"{file}: tensor {have!r} has no lora_{'B' if 'A' in ab else 'A'} partner; "
            "the adapter file is incomplete. Re-save it."
        )
    layer, weight_name, rows = slot
    w = getattr(weights.layers[layer], weight_name)  # [out, in]
    in_dim, out_dim = w.shape[1], rows.stop - rows.start
    a_t, b_t = tensors[ab["A"]], tensors[ab["B"]]
    rank = a_t.shape[0] if len(a_t.shape) == 2 else -1
    for t_name, t, expected in ((ab["A"], a_t, (expected_rank, in_dim)), (ab["B"], b_t, (out_dim, expected_rank))):
        if tuple(t.shape) != expected:
            raise AdapterError(
                f"tensor {t_name!r} in {file} has shape {tuple(t.shape)}, expected {expected} "
                f"(r={expected_rank}, module {in_dim} -> {out_dim}); the adapter was trained for another "
                "base model (or another rank than adapter_config.json says)."
            )
    try:
        a, b = a_t.to_float32(), b_t.to_float32()
    except WeightsError as exc:
        raise AdapterError(f"{file}: {exc}") from None
    return LoraDelta(module=module, layer=layer, weight=weight_name, rows=rows, a=a, b=b, scaling=scaling_for(rank))


def _full_names(config: ModelConfig) -> set[str]:
    """Every whole-tensor name of the family (a modules_to_save file may carry these)."""
    return {n.format(i=i) for n in NAME_MAPS[config.family].values() for i in range(config.num_hidden_layers)}


def _pattern_rank(module: str, rank_pattern: dict, r: int) -> int:
    """PEFT's rank for ``module``: the first ``rank_pattern`` key that matches its name's end."""
    for key, rank in rank_pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return int(rank)
    return r


def _base_model_notes(adapter: LoraAdapter, model_names: tuple[str, ...]) -> list[str]:
    base = adapter.base_model
    if not base:
        return [f"adapter {adapter.name}: adapter_config.json names no base model; shapes checked, applying it"]
    short = {Path(str(n)).name.lower() for n in model_names if n}
    if Path(base).name.lower() in short:
        return []
    known = " / ".join(dict.fromkeys(str(n) for n in model_names if n)) or "?"
    return [
        f"adapter {adapter.name} was trained on {base!r}, loaded model is {known}: the shapes match, "
        "so it is applied; check it is the right base model"
    ]


# --- applying ------------------------------------------------------------------------------------------
def merge(adapter: LoraAdapter, weights: Weights) -> None:
    """Fold the adapter into the base weights for good: ``W[rows] += scaling * B @ A``."""
    for delta in adapter.deltas:
        w = getattr(weights.layers[delta.layer], delta.weight).dense  # [out, in] float32: a fresh array at load
        w[delta.rows] += delta.product()
    adapter.mode = "merged"


def activate(adapters: list[LoraAdapter], weights: Weights) -> None:
    """Make ``adapters`` the ones the forward adds (unmerged mode); an empty list runs the base model."""
    for layer in weights.layers:
        layer.lora = {}
    for adapter in adapters:
        for delta in adapter.deltas:
            weights.layers[delta.layer].lora.setdefault(delta.weight, []).append(delta)
