"""What names a served model: ``NAME[:DTYPE]`` on the command line and in a request, and where a
``:gguf`` plan reads its packed sizes from."""

from __future__ import annotations

from dataclasses import dataclass

from minillm.runtime.loading import WEIGHT_DTYPES


@dataclass(frozen=True)
class ModelSpec:
    """A served model: ``served`` (the name clients pass), ``source`` (for ``minillm.load``), ``weight_dtype``."""

    served: str
    source: str
    weight_dtype: str

    @classmethod
    def parse(cls, text: str, default_dtype: str = "float32") -> ModelSpec:
        """``"smollm2-135m-instruct:int8"`` -> that model held at int8; a name without a known
        ``:DTYPE`` suffix is all name (a folder may contain ':')."""
        head, _, tail = text.rpartition(":")
        if head and tail in WEIGHT_DTYPES:
            return cls(text, head, tail)
        return cls(text, text, default_dtype)


def gguf_file(source: str):
    """The model's GGUF file for a ``:gguf`` plan: its header sizes the packed weights (the cached
    file, else fetched as the load would fetch it: ``sources.hub.resolve_gguf``)."""
    from minillm.sources.hub import resolve_gguf

    return resolve_gguf(source, progress=True)
