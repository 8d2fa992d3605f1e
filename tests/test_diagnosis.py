"""The diagnosis table: each slow phase is named, from measured (here: constructed) times."""

from minillm.observe.diagnosis import TABLE, diagnose
from minillm.runtime.request import RequestMetrics


def metrics(prompt_tokens=8, ttft=0.05, steps=(0.016,) * 16):
    return RequestMetrics(prompt_tokens=prompt_tokens, new_tokens=len(steps) + 1, ttft_s=ttft,
                          prefill_s=ttft * 0.9, decode_step_s=list(steps))


def test_slow_load_points_to_loading():
    d = diagnose(metrics(), load_s=30.0, warmup_s=0.2, first_request=True)
    assert d.dominant == "loading" and d.main == ("loading", *TABLE["loading"])


def test_long_prompt_points_to_prefill():
    d = diagnose(metrics(prompt_tokens=1024, ttft=3.0), load_s=1.0, warmup_s=0.2)
    assert d.dominant == "prefill" and d.main[1] == "long input delays the first token"


def test_short_prompt_slow_first_token_without_warmup_points_to_warmup():
    d = diagnose(metrics(prompt_tokens=6, ttft=2.0), load_s=1.0, warmup_s=None, first_request=True)
    assert d.dominant == "warm-up" and d.main[1] == "first request slow"


def test_slow_steps_point_to_decode():
    d = diagnose(metrics(steps=(0.2,) * 40), load_s=1.0, warmup_s=0.2)
    assert d.dominant == "decode" and d.main[1] == "slow after the first token"
    assert abs(d.phase_seconds["decode"] - 0.2 * 40) < 1e-9


def test_skipped_warmup_is_mentioned_even_when_decode_dominates():
    d = diagnose(metrics(steps=(0.2,) * 40), load_s=1.0, warmup_s=None, first_request=True)
    assert [f[0] for f in d.findings] == ["decode", "warm-up"]


def test_odd_fragments_point_to_the_tokenizer():
    d = diagnose(metrics(), load_s=1.0, warmup_s=0.1, text="Paris<|im_end|>", special_tokens=("<|im_end|>",))
    assert d.main[0] == "tokenizer" and "<|im_end|>" in d.main[1]
    d = diagnose(metrics(), load_s=1.0, warmup_s=0.1, text="caf\ufffd")
    assert d.main[0] == "tokenizer" and "U+FFFD" in d.main[1]


def test_a_slow_warmup_that_ran_is_reported_as_paid_before_ready():
    d = diagnose(metrics(), load_s=1.0, warmup_s=5.0, first_request=True)
    assert d.dominant == "warm-up" and d.main[1] == "slow to become ready (warm-up)"
    assert "before 'ready'" in d.main[2]


def test_a_later_request_is_not_blamed_on_loading_or_warmup():
    d = diagnose(metrics(), load_s=30.0, warmup_s=5.0, first_request=False)
    assert d.dominant == "decode" and d.phase_seconds["loading"] == 0 and d.phase_seconds["warm-up"] == 0


def busy(share, steps=(0.2,) * 40, prompt_tokens=8, ttft=0.05):
    """diagnose()'s arguments for a request during which other processes used ``share`` of the cores."""
    return {"metrics": metrics(prompt_tokens=prompt_tokens, ttft=ttft, steps=steps), "others_cpu_share": share}


def test_blas_threads_on_a_shared_machine_point_to_threads_first():
    d = diagnose(**busy(0.45), load_s=1.0, warmup_s=0.2, blas_threads=2)
    assert d.dominant == "decode" and [f[0] for f in d.findings] == ["threads", "decode"]
    assert d.main[1] == "slow on a shared machine (other processes used 45% of the cores)"
    assert d.main[2].startswith("threads: 2 BLAS threads compete with other processes for ")
    assert d.main[2].endswith("run with --threads 1 (minillm.load(..., threads=1))")
    # a long prompt on a shared machine: the same advice, before prefill's
    d = diagnose(**busy(0.5, steps=(0.01,), prompt_tokens=1024, ttft=3.0), load_s=1.0, warmup_s=0.2, blas_threads=2)
    assert [f[0] for f in d.findings] == ["threads", "prefill"]
    # a short prompt whose prefill was slow only because of the neighbour: the prompt is not blamed
    d = diagnose(**busy(0.5, steps=(0.01,), prompt_tokens=5, ttft=3.0), load_s=1.0, warmup_s=0.2, blas_threads=2)
    assert d.dominant == "prefill" and [f[0] for f in d.findings] == ["threads"]


def test_no_threads_finding_on_a_quiet_machine_one_thread_or_unknown_share():
    for share, threads in [(0.1, 2), (0.6, 1), (float("nan"), 2), (0.6, None)]:
        d = diagnose(**busy(share), load_s=1.0, warmup_s=0.2, blas_threads=threads)
        assert [f[0] for f in d.findings] == ["decode"], (share, threads)
    d = diagnose(**busy(0.6, steps=(0.01,)), load_s=30.0, warmup_s=0.2, first_request=True, blas_threads=2)
    assert [f[0] for f in d.findings] == ["loading"]  # slow loading is not the BLAS threads' fault


def test_a_slow_load_from_the_cache_does_not_blame_downloads():
    d = diagnose(metrics(), load_s=30.0, warmup_s=0.2, first_request=True, load_source="cache")
    assert d.main == ("loading", *TABLE["loading (cached)"])
    assert "no download or conversion" in d.main[2]
    d = diagnose(metrics(), load_s=30.0, warmup_s=0.2, first_request=True, load_source="offline")
    assert d.main == ("loading", *TABLE["loading"])
