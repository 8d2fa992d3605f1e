"""Per-key quotas, and what each key used, counted in /metrics under the key's label.

    --requests-per-minute N      requests a key may start in any 60 s (a request starts when it is queued)
    --tokens-per-minute N        prompt + completion tokens a key's requests may spend in any 60 s; a
                                 request's tokens count when it ends, so one request may go past the
                                 quota: the key's next one waits until enough of the minute has passed
    --max-concurrent-per-key N   a key's requests in flight at once (queued or running)

Past one: 429 in OpenAI's shape (code ``rate_limit_exceeded``, type ``requests`` or ``tokens``) with
``Retry-After``: whole seconds until the oldest start (or enough spent tokens) leaves the window; 1
for the concurrency quota. Other keys are served meanwhile: each key has its own window.

    minillm_key_requests_total{key}               requests started (queued)
    minillm_key_prompt_tokens_total{key}          prompt tokens of its finished requests (their usage)
    minillm_key_completion_tokens_total{key}      completion tokens of its finished requests (their usage)
    minillm_key_rate_limited_total{key, limit}    429s by quota: requests_per_minute, tokens_per_minute, concurrent

Everything here runs on the event loop (the handler, and the job's channel when the request ends):
no lock is needed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from .auth import QuotaLimits
from .responses import APIError

WINDOW_S = 60.0  # the quotas' minute, seconds


@dataclass
class _Use:
    """One key's recent use: start times, (end time, tokens) of finished requests, requests in flight."""

    starts: deque = field(default_factory=deque)
    spent: deque = field(default_factory=deque)
    in_flight: int = 0


class Quotas:
    """The per-key quotas and counters of one server.

    Args:
        registry: the server's Prometheus registry (the per-key counters join it).
        limits: the quotas (None in a field: no limit).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, registry: CollectorRegistry, limits: QuotaLimits, clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self.uses: dict[str, _Use] = {}
        r = registry
        self.requests = Counter("minillm_key_requests", "Requests a key started (queued)", ["key"], registry=r)
        self.prompt_tokens = Counter(
            "minillm_key_prompt_tokens", "Prompt tokens of a key's finished requests", ["key"], registry=r
        )
        self.completion_tokens = Counter(
            "minillm_key_completion_tokens", "Completion tokens of a key's finished requests", ["key"], registry=r
        )
        self.limited = Counter(
            "minillm_key_rate_limited", "Requests refused with 429 by a key's quota", ["key", "limit"], registry=r
        )

    def check(self, key: str | None) -> None:
        """Refuse the key's next request if a quota is spent (no key: an open server, no quota).

        Raises:
            APIError: 429 ``rate_limit_exceeded`` with ``Retry-After`` (seconds).
        """
        if key is None:
            return
        use, now, lim = self._use(key), self.clock(), self.limits
        if lim.concurrent is not None and use.in_flight >= lim.concurrent:
            why = f"{use.in_flight} requests of this key are in flight (--max-concurrent-per-key {lim.concurrent})"
            self._refuse(key, "concurrent", "requests", 1.0, why)
        if lim.requests_per_minute is not None and len(use.starts) >= lim.requests_per_minute:
            n, limit = len(use.starts), lim.requests_per_minute
            why = f"this key started {n} requests in the last minute (--requests-per-minute {limit})"
            self._refuse(key, "requests_per_minute", "requests", use.starts[0] + WINDOW_S - now, why)
        spent = sum(n for _, n in use.spent)
        if (limit := lim.tokens_per_minute) is not None and spent >= limit:
            left, wait = spent, 0.0
            for t, n in use.spent:  # the oldest first: when enough of them have left the window
                left, wait = left - n, t + WINDOW_S - now
                if left < limit:
                    break
            why = f"this key's requests spent {spent:,} tokens in the last minute (--tokens-per-minute {limit:,})"
            self._refuse(key, "tokens_per_minute", "tokens", wait, why)

    def started(self, key: str | None) -> None:
        """The key's request was queued: it counts against the minute and the concurrency quota."""
        if key is None:
            return
        use = self._use(key)
        use.starts.append(self.clock())
        use.in_flight += 1
        self.requests.labels(key=key).inc()

    def ended(self, key: str | None, item) -> None:
        """The key's request ended with ``item``: ``("done", Outcome)`` spends its usage; an error, nothing."""
        if key is None:
            return
        use = self._use(key)
        use.in_flight -= 1
        kind, outcome = item
        if kind == "done":
            use.spent.append((self.clock(), outcome.prompt_tokens + outcome.completion_tokens))
            self.prompt_tokens.labels(key=key).inc(outcome.prompt_tokens)
            self.completion_tokens.labels(key=key).inc(outcome.completion_tokens)

    def _use(self, key: str) -> _Use:
        """The key's use, with what is older than the window forgotten."""
        use = self.uses.setdefault(key, _Use())
        oldest = self.clock() - WINDOW_S
        while use.starts and use.starts[0] <= oldest:
            use.starts.popleft()
        while use.spent and use.spent[0][0] <= oldest:
            use.spent.popleft()
        return use

    def _refuse(self, key: str, limit: str, type_: str, wait_s: float, why: str) -> None:
        self.limited.labels(key=key, limit=limit).inc()
        retry = max(1, math.ceil(wait_s))
        raise APIError(
            429,
            f"rate limit reached: {why}, the most allowed; retry after {retry} s",
            type_,
            code="rate_limit_exceeded",
            headers={"Retry-After": str(retry)},
        )
