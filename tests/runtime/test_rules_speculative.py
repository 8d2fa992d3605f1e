"""Speculative decoding's rules that change what a request does, each pinned by a fast test (issue 49).

- Adaptive ``k`` (``speculative.next_k``, applied in ``SpeculativeDecoder.settle``): a pass whose drafts
  were all kept asks for one more than it *asked* for next time, even when the draft proposed fewer
  than asked (prompt lookup ran out of text): the short run says nothing against a longer one.
- Prompt lookup (``drafts.NgramDraft``) proposes what followed the *newest* earlier match of the last
  n tokens (its docstring; vLLM and transformers do the same): the most recent text is the likeliest
  to repeat.

The model is the suite's tiny NumPy Llama (tests/support/tiny_models.py: one layer, 8 wide, seeded)
over the scripted word vocabulary: loaded in milliseconds, no torch.
"""

from __future__ import annotations

import pytest
from tiny_models import tiny_word_model

import minillm
from minillm.runtime.drafts import Draft, NgramDraft
from minillm.runtime.loading import Model
from minillm.runtime.speculative import Speculative


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Model:
    return tiny_word_model(tmp_path_factory.mktemp("rules-spec"))


class ShortOracle(Draft):
    """Proposes the model's own greedy continuation (so every draft is kept), but never more than
    ``most`` tokens, whatever ``k`` it is asked for; records each ``k`` asked."""

    def __init__(self, answer: list[int], prompt_len: int, most: int = 2):
        self.answer, self.prompt_len, self.most = answer, prompt_len, most
        self.asked: list[int] = []

    def propose(self, tokens, k, choose=None):
        self.asked.append(k)
        done = len(tokens) - self.prompt_len  # new tokens so far
        return self.answer[done : done + min(k, self.most)], None


def test_a_short_fully_kept_proposal_still_grows_k(tiny):
    """By hand: k starts at 1; a pass whose drafts are all kept asks k + 1 next, although from k = 3
    on the draft proposes only 2 (a pass then gives 3 tokens). New tokens before each pass: 1 (the
    prefill's), 3, 6, 9, 12, 15, 18, 21; k grows 1, 2, 3, 4, 5, 6, then stays at num_tokens 6, and
    at 21 only 25 - 21 - 1 = 3 may be drafted; at 24 none (the last token is a plain step).
    Growing from what was proposed instead (2 + 1) would ask 1, 2, 3, 3, 3, 3, 3, 3."""
    prompt = "AB C DEF"
    plain = minillm.generate(tiny, prompt, max_new_tokens=25)
    assert plain.stop_reason is minillm.StopReason.MAX_NEW_TOKENS  # no EOS cuts the run short
    draft = ShortOracle(plain.ids, len(plain.prompt_ids))
    spec = minillm.generate(tiny, prompt, max_new_tokens=25, speculative=Speculative(draft, num_tokens=6))
    assert spec.ids == plain.ids
    assert draft.asked == [1, 2, 3, 4, 5, 6, 6, 3]
    assert spec.metrics.drafted_tokens == spec.metrics.accepted_tokens == 1 + 2 * 7
    assert spec.metrics.rejections == 0


def test_prompt_lookup_proposes_from_the_newest_match():
    """"1 2" occurs twice before the end: followed by 9 (oldest) and by 8 (newest); the newest wins."""
    tokens = [1, 2, 9, 4, 1, 2, 8, 5, 1, 2]
    assert NgramDraft(min_n=2, max_n=2).propose(tokens, 2) == ([8, 5], None)
    assert NgramDraft(min_n=1, max_n=1).propose([7, 3, 7, 4, 7], 1) == ([4], None)  # one-token n-grams too
    # the longest n first: "5 1 2" (n = 3) occurs once, at the newest "1 2" as well
    assert NgramDraft(min_n=1, max_n=3).propose(tokens, 3) == ([8, 5, 1], None)
    # a longer match found further back beats a newer shorter one: "3 1 2" (n = 3) once, oldest
    assert NgramDraft(min_n=1, max_n=3).propose([3, 1, 2, 6, 1, 2, 7, 3, 1, 2], 1) == ([6], None)
