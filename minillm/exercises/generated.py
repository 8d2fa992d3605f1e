"""Generated cases for the checks: hypothesis, seeded by ``--seed``, each failure shrunk to its smallest
example; and the context a check runs in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Context:
    """What a check needs besides the student's module: the seed of the generated cases, how many to
    generate, and (lazily) SmolLM2's tokenizer for the detokenizer's cases."""

    seed: int = 0
    examples: int = 25
    tokenizer_factory: Callable[[], object] | None = None
    _tokenizer: object = field(default=None, repr=False)

    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.tokenizer_factory()
        return self._tokenizer


def generated(ctx: Context, strategy, check: Callable) -> None:
    """Run ``check(example)`` on ``ctx.examples`` examples of ``strategy``, seeded by ``ctx.seed``;
    the first failure is shrunk to its smallest example and re-raised."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    @seeded(ctx.seed)
    @settings(
        max_examples=ctx.examples,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.generate, Phase.shrink),
        print_blob=False,
    )
    @given(strategy)
    def run(example):
        check(example)

    run()


def rng_for(ctx: Context, *salt: int) -> np.random.Generator:
    return np.random.default_rng([ctx.seed, *salt])


def st():
    import hypothesis.strategies as strategies

    return strategies
