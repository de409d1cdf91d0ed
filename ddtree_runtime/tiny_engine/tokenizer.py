"""A deterministic tokenizer for the lab models: the lab language's words as whole tokens, bytes for the rest.

Ids 0..255 are raw bytes, then the special tokens, then one token per lab word (with its leading space, as
BPE vocabularies have). Encoding is greedy longest-match, so any text round-trips through bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

NUM_BYTES = 256
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
EOS_TOKEN_ID = NUM_BYTES + 0
IM_START_ID = NUM_BYTES + 1
IM_END_ID = NUM_BYTES + 2
MASK_TOKEN_ID = NUM_BYTES + 3

# The lab language's words (see models.TinyLanguage); order fixes the ids, never reorder.
LAB_WORDS = (
    "the", "a", "cat", "dog", "bird", "fox", "tree", "river", "stone", "house", "garden", "road",
    "sees", "finds", "likes", "follows", "carries", "watches", "builds", "paints",
    "red", "small", "old", "quiet", "bright", "green", "tall", "slow",
    "and", "then", "near", "under", "over", "with", "while", "because",
    "morning", "evening", "rain", "wind", "light", "shadow", "song", "story",
    "runs", "sleeps", "waits", "sings",
)  # fmt: skip
WORD_TOKENS = (*(" " + w for w in LAB_WORDS), ".", "user", "assistant")
VOCAB_SIZE = 320  # padded like real vocabularies (multiple of 64)


class TinyTokenizer:
    """Byte fallback + special tokens + whole-word tokens; ids are stable across versions."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = [bytes([i]) for i in range(NUM_BYTES)]
        self.pieces += [s.encode() for s in SPECIAL_TOKENS]
        self.pieces += [w.encode() for w in WORD_TOKENS]
        if len(self.pieces) > VOCAB_SIZE:
            raise AssertionError("lab vocabulary overflows VOCAB_SIZE")
        self._by_piece = {p: i for i, p in enumerate(self.pieces) if i >= NUM_BYTES}
        self._max_len = max(len(p) for p in self._by_piece)
        self.vocab_size = VOCAB_SIZE
        self.eos_token_id = EOS_TOKEN_ID
        self.mask_token_id = MASK_TOKEN_ID

    def token_id(self, piece: str) -> int:
        return self._by_piece[piece.encode()]

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        ids: list[int] = []
        i = 0
        while i < len(data):
            for n in range(min(self._max_len, len(data) - i), 1, -1):
                hit = self._by_piece.get(data[i : i + n])
                if hit is not None:
                    ids.append(hit)
                    i += n
                    break
            else:
                single = self._by_piece.get(data[i : i + 1])  # one-byte words ('.')
                ids.append(single if single is not None else data[i])
                i += 1
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for t in ids:
            if not 0 <= t < len(self.pieces):
                continue  # padding rows of the vocabulary never decode to text
            if skip_special_tokens and NUM_BYTES <= t < NUM_BYTES + len(SPECIAL_TOKENS):
                continue
            out += self.pieces[t]
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Qwen's ChatML layout, ending with the assistant turn's header."""
        parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        return "".join(parts) + "<|im_start|>assistant\n"

    def save(self, directory: Path) -> None:
        """A vocab listing, so a model directory is self-describing (``hf_tokenizer`` writes the same
        tokenizer in Hugging Face's format beside it)."""
        vocab = {p.decode("latin-1"): i for i, p in enumerate(self.pieces)}
        (directory / "vocab.json").write_text(json.dumps(vocab, sort_keys=True) + "\n")
