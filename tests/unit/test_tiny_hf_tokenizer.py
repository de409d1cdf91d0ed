"""The lab tokenizer in Hugging Face's format (what a real SGLang server loads) gives TinyTokenizer's ids."""

from __future__ import annotations

import random

import pytest

from ddtree_runtime.tiny_engine.hf_tokenizer import save_hf_tokenizer
from ddtree_runtime.tiny_engine.language import TinyLanguage
from ddtree_runtime.tiny_engine.tokenizer import EOS_TOKEN_ID, TinyTokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    lab = TinyTokenizer()
    directory = tmp_path_factory.mktemp("tok")
    save_hf_tokenizer(lab, directory)
    return lab, transformers.AutoTokenizer.from_pretrained(str(directory))


def test_ids_and_text_match_the_lab_tokenizer(pair):
    lab, hf = pair
    lang = TinyLanguage(lab, seed=3)
    rng = random.Random(0)
    texts = ["the cat sees the dog.", "théâtre  caté the..", "The capital of France is", " the\n\tend"]
    samples = [lang.sample(40, rng, chat=i % 3 == 0) for i in range(150)]
    texts += [lab.decode(ids, skip_special_tokens=False) for ids in samples]
    for text in texts:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ids == lab.encode(text), text
        assert hf.decode(ids, skip_special_tokens=True) == lab.decode(ids), text


def test_special_tokens_and_chat_template(pair):
    lab, hf = pair
    assert hf.eos_token_id == EOS_TOKEN_ID
    messages = [{"role": "user", "content": "the old fox"}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == lab.apply_chat_template(messages)
    assert hf(rendered, add_special_tokens=False)["input_ids"] == lab.encode(rendered)
