"""The lab tokenizer as a Hugging Face ``tokenizer.json``, so a real SGLang server can load the lab models.

``TinyTokenizer`` encodes by greedy longest match over raw bytes (word pieces carry their leading space,
``.`` and the special tokens are pieces too, every other byte is its own id). ``tokenizers``' WordPiece
model is also greedy longest match, so the same ids come out when

* a ByteLevel pre-tokenizer (no regex) first maps every byte to one printable character (non-ASCII
  text is matched byte by byte, as ``TinyTokenizer`` does);
* a Split before every space cuts the text into chunks; no piece holds a space except as its first
  character, so no piece spans two chunks and greedy matching per chunk is greedy matching overall;
* the continuation prefix is empty, so a piece matches the same way at a chunk's start and inside it
  (one vocabulary entry per id: ``transformers`` rebuilds the model from an id -> token map, which
  would drop a second spelling of an id);
* the special tokens are added tokens with their own ids (matched before anything else).

Byte 46 is the one id left out: ``.`` is also a word piece (id 308), which ``TinyTokenizer`` always
picks, so id 46 is never produced by encoding; the tiny models do not emit it either (trained on
``TinyTokenizer``'s encodings), and if one did, decoding would skip it.
``tests/unit/test_tiny_hf_tokenizer.py`` checks ids and text against ``TinyTokenizer`` on the lab language
and on arbitrary text.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from ddtree_runtime.tiny_engine.tokenizer import NUM_BYTES, SPECIAL_TOKENS, TinyTokenizer

# Qwen's ChatML, the layout TinyTokenizer.apply_chat_template writes.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@cache
def byte_chars() -> tuple[str, ...]:
    """GPT-2's byte -> printable character map (what tokenizers' ByteLevel pre-tokenizer uses)."""
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return tuple(chars[b] for b in range(256))


def tokenizer_spec(lab: TinyTokenizer) -> dict:
    """The ``tokenizer.json`` document (see module docstring)."""
    chars = byte_chars()
    vocab: dict[str, int] = {}
    special_ids = range(NUM_BYTES, NUM_BYTES + len(SPECIAL_TOKENS))
    for token_id, piece in enumerate(lab.pieces):
        if token_id in special_ids:
            vocab[piece.decode()] = token_id
            continue
        mapped = "".join(chars[b] for b in piece)
        vocab[mapped] = token_id  # later (word) pieces win over a byte of the same text ('.')
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": token_id, "content": SPECIAL_TOKENS[token_id - NUM_BYTES], "single_word": False,
             "lstrip": False, "rstrip": False, "normalized": False, "special": True}
            for token_id in special_ids
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "ByteLevel", **byte_level},
            {"type": "Split", "pattern": {"String": chars[ord(" ")]}, "behavior": "MergedWithNext",
             "invert": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "WordPiece", "unk_token": chars[0], "continuing_subword_prefix": "",
                  "max_input_chars_per_word": 1_000_000, "vocab": vocab},
    }


def tokenizer_config(lab: TinyTokenizer) -> dict:
    """``tokenizer_config.json`` for ``PreTrainedTokenizerFast`` (what ``AutoTokenizer`` loads)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "model_max_length": 32768,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_hf_tokenizer(lab: TinyTokenizer, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_spec(lab), ensure_ascii=False) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(lab), indent=2) + "\n")
