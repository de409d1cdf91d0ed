"""The lab language: a seeded word-level Markov chain the lab target is trained on, and the lab prompts.

Each word has three successors with probabilities 0.7 / 0.2 / 0.1. The most likely successors form one cycle
through every word, so greedy output walks the whole vocabulary (varied text, never a one-token loop), while
sampling at T > 0 branches. A drafter that predicts several steps ahead has to learn that walk, which a tiny
drafter trained briefly does only partly: acceptance is real and well below the block size.
"""

from __future__ import annotations

import random

from ddtree_runtime.tiny_engine.tokenizer import IM_END_ID, IM_START_ID, WORD_TOKENS, TinyTokenizer

SUCCESSOR_PROBS = (0.7, 0.2, 0.1)

# Prompts the lab's probes, tests and benchmark use (in-language, so the drafter has something to predict).
LAB_PROMPTS = (
    "the cat sees a",
    "under the old tree",
    "morning rain and",
    "the fox carries a small stone",
    "quiet evening",
    "a bird sings while the river",
)


class TinyLanguage:
    def __init__(self, tokenizer: TinyTokenizer, seed: int = 1234) -> None:
        rng = random.Random(seed)
        self.words = [tokenizer.token_id(w) for w in _chain_words(tokenizer)]
        n = len(self.words)
        order = rng.sample(range(n), n)
        successors: dict[int, list[int]] = {}
        for i, w in enumerate(order):  # greedy cycle: order[i] -> order[i+1]
            first = order[(i + 1) % n]
            others = [x for x in rng.sample(range(n), n) if x not in (w, first)][:2]
            successors[self.words[w]] = [self.words[first]] + [self.words[x] for x in others]
        self.successors = successors
        self.user_id = tokenizer.token_id("user")
        self.assistant_id = tokenizer.token_id("assistant")
        self.newline_id = ord("\n")

    def sample(self, length: int, rng: random.Random, *, chat: bool = False) -> list[int]:
        """One training sequence; with chat=True a ChatML user turn, then the assistant continuing it."""
        cur = rng.choice(self.words)
        seq = [cur]
        header: list[int] = []
        if chat:
            header = [IM_START_ID, self.user_id, self.newline_id]
        while len(seq) + len(header) < length:
            cur = rng.choices(self.successors[cur], weights=SUCCESSOR_PROBS)[0]
            seq.append(cur)
            if chat and len(seq) == 4:  # end the user turn, the assistant continues the chain
                seq += [IM_END_ID, self.newline_id, IM_START_ID, self.assistant_id, self.newline_id]
        return (header + seq)[:length]


def _chain_words(tokenizer: TinyTokenizer) -> list[str]:
    return [w for w in WORD_TOKENS if w not in ("user", "assistant")]
