"""SGLang's request contract as the lab server reads it: bodies parsed and checked, 400s worded like SGLang's.

A body that breaks SGLang 0.5.23's JSON contract (sglang.api.v1's types: `top_k` 2.5 is "invalid type:
floating point `2.5`, expected i64") or its sampling checks (SamplingParams.verify: temperature NaN,
top_p 0, ...) is a :class:`BadRequest`, which the HTTP side answers with 400. A request without a
temperature samples at 1.0 and one below 1e-6 is greedy, as in SGLang.
"""

from __future__ import annotations

import math
from typing import Any

from ddtree_runtime.tiny_engine.server_view import TinyServerView

SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a lower temperature means greedy
DEFAULT_TEMPERATURE = 1.0  # SGLang's SamplingParams default: a request without one samples
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"


class BadRequest(ValueError):
    """A request body SGLang would answer with 400 (`contract`: its JSON-contract gate's bare-string body)."""

    def __init__(self, message: str, *, contract: bool = False) -> None:
        super().__init__(message)
        self.contract = contract


# ---------------------------------------------------------------------------- SGLang's sampling contract

# sglang.api.v1.SamplingParams' JSON types (api_types.decode_SamplingParams), field by field.
_SAMPLING_TYPES = {
    "max_new_tokens": "i64", "stop": "str_or_list", "stop_token_ids": "i64_list", "stop_regex": "str_or_list",
    "temperature": "f64", "top_p": "f64", "top_k": "i64", "min_p": "f64", "frequency_penalty": "f64",
    "presence_penalty": "f64", "repetition_penalty": "f64", "min_new_tokens": "i64", "n": "i64",
    "json_schema": "str", "regex": "str", "ebnf": "str", "structural_tag": "str", "ignore_eos": "bool",
    "skip_special_tokens": "bool", "spaces_between_special_tokens": "bool", "no_stop_trim": "bool",
    "stream_interval": "i64", "logit_bias": "f64_map", "sampling_seed": "i64", "custom_params": "any",
    "beam_width": "i64", "watermark": "map", "choice": "str_list",
}  # fmt: skip
# What the lab engine does with them: its own fields, fields it accepts and ignores, the rest it refuses.
_LAB_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos", "stop_token_ids"}
_LAB_IGNORED = {"min_new_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop",
                "skip_special_tokens", "n", "min_p", "no_stop_trim", "spaces_between_special_tokens",
                "stream_interval"}


def _unexpected(v: Any) -> str:
    """serde's `Unexpected` display, as SGLang prints it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v[:100]}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _invalid(v: Any, expected: str) -> str:
    return f"invalid type: {_unexpected(v)}, expected {expected}"


_SCALARS = {"i64": (_is_int, "i64"), "f64": (_is_number, "f64"),
            "bool": (lambda x: isinstance(x, bool), "a boolean"),
            "str": (lambda x: isinstance(x, str), "a string")}


def _contract_error(kind: str, v: Any) -> str | None:
    """SGLang's decoder's message for a value of the wrong JSON type (api_types.decode_*), or None."""
    if kind in _SCALARS:
        ok, expected = _SCALARS[kind]
        return None if ok(v) else _invalid(v, expected)
    if kind in ("str_or_list", "str_list", "i64_list"):
        if kind == "str_or_list" and not isinstance(v, list):
            return None if isinstance(v, str) else _invalid(v, "a value or an array of values for "
                                                               "StringOrList")
        if not isinstance(v, list):
            return _invalid(v, "a sequence")
        element = "i64" if kind == "i64_list" else "str"
        return next((err for e in v if (err := _contract_error(element, e))), None)
    if kind == "f64_map":
        if not isinstance(v, dict):
            return _invalid(v, "a map")
        return next((err for e in v.values() if (err := _contract_error("f64", e))), None)
    if kind == "map":
        return None if isinstance(v, dict) else _invalid(v, "struct WatermarkRequestConfig")
    return None


def sampling_params(raw: Any, vocab_size: int) -> dict:
    """SGLang's sampling_params checks, in its order, for one request: (1) the JSON contract (unknown
    fields, types), (2) SamplingParams' normalisation and verify() (ranges, NaN). Returns what the lab
    engine's SamplingParams.from_dict takes. Raises BadRequest worded as SGLang words it."""
    if not isinstance(raw, dict):
        raise BadRequest(f"invalid type: {_unexpected(raw)}, expected struct SamplingParams", contract=True)
    for key, value in raw.items():
        kind = _SAMPLING_TYPES.get(key)
        if kind is None:
            listed = ", ".join(f"`{f}`" for f in _SAMPLING_TYPES)
            raise BadRequest(f"unknown field `{str(key)[:100]}`, expected one of {listed}", contract=True)
        if value is not None and (error := _contract_error(kind, value)):
            raise BadRequest(error, contract=True)
    sp = {k: v for k, v in raw.items() if v is not None}  # null = the default, as in SGLang
    sp.setdefault("temperature", DEFAULT_TEMPERATURE)  # SGLang samples unless asked for greedy
    temperature, top_k = sp["temperature"], sp.get("top_k")
    if 0 <= temperature < SAMPLING_EPS:
        sp["temperature"], temperature = 0.0, 0.0  # greedy: SGLang sets top_k = 1
    _verify(sp, temperature, top_k)
    if top_k is not None and (top_k == -1 or top_k >= min(vocab_size, TOP_K_ALL)):
        sp["top_k"] = -1  # the whole vocabulary
    unsupported = sorted(set(sp) - _LAB_FIELDS - _LAB_IGNORED)
    if unsupported:
        raise BadRequest(f"sampling_params {', '.join(unsupported)}: not supported by the lab engine "
                         "(SGLang 0.5.23 accepts them; the lab decodes without grammars, seeds or biases)")
    if isinstance(sp.get("temperature"), int):
        sp["temperature"] = float(sp["temperature"])
    return {k: v for k, v in sp.items() if k in _LAB_FIELDS}


def _verify(sp: dict, temperature: Any, top_k: Any) -> None:
    """SamplingParams.verify() of SGLang 0.5.23, the checks that apply to what the lab decodes, with its
    messages (values shown as sent)."""
    def outside(key: str, default: float, low: float, high: float, *, open_low: bool = False) -> bool:
        try:
            number = float(sp.get(key, default))
        except OverflowError:  # an integer of hundreds of digits
            return True
        return not (low < number <= high if open_low else low <= number <= high)

    if temperature is not None and outside("temperature", 1.0, 0.0, math.inf):
        raise BadRequest(f"temperature must be a non-negative finite number, got {_shown(temperature)}.")
    if outside("top_p", 1.0, 0.0, 1.0, open_low=True):
        raise BadRequest(f"top_p must be in (0, 1], got {_shown(sp['top_p'])}.")
    if outside("min_p", 0.0, 0.0, 1.0):
        raise BadRequest(f"min_p must be in [0, 1], got {_shown(sp['min_p'])}.")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {_shown(top_k)}.")
    for key in ("frequency_penalty", "presence_penalty"):
        if outside(key, 0.0, -2.0, 2.0):
            raise BadRequest(f"{key} must be in [-2, 2], got {_shown(sp[key])}.")
    if outside("repetition_penalty", 1.0, 0.0, 2.0, open_low=True):
        raise BadRequest("repetition_penalty must be in (0, 2] (1.0 = no penalty), "
                         f"got {_shown(sp['repetition_penalty'])}.")
    min_new, max_new = sp.get("min_new_tokens", 0), sp.get("max_new_tokens")
    if min_new < 0:
        raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens], got {_shown(min_new)}.")
    if max_new is not None:
        if max_new < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {_shown(max_new)}.")
        if min_new > max_new:
            raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens({_shown(max_new)})], "
                             f"got {_shown(min_new)}.")


def _shown(value: Any) -> str:
    text = str(value) if not (isinstance(value, int) and abs(value) > 10**60) else "a huge integer"
    return text if len(text) <= 60 else text[:40] + "..."


def parse_generate(body: dict, lab: TinyServerView) -> tuple[list[list[int]], list, bool]:
    """SGLang's GenerateReqInput subset: (prompts, params, batched)."""
    from ddtree_runtime.tiny_engine.engine import SamplingParams

    for key, kind in (("stream", "bool"), ("return_text_in_logprobs", "bool"), ("rid", "str_or_list")):
        if body.get(key) is not None and (error := _contract_error(kind, body[key])):
            raise BadRequest(error, contract=True)
    for key, kind in (("return_logprob", "bool"), ("logprob_start_len", "i64"), ("top_logprobs_num", "i64")):
        value = body.get(key)
        if value is not None and (error := next((e for v in (value if isinstance(value, list) else [value])
                                                 if (e := _contract_error(kind, v))), None)):
            raise BadRequest(error, contract=True)
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None and ids is not None:
        raise BadRequest("Either text or input_ids should be provided, not both.")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the lab engine; send stream=false.")
    tok = lab.engine.tokenizer
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings.")
        prompts = [tok.encode(_unicode(t)) for t in texts]
    else:
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(
                isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                for p in prompts
            )
        ):
            raise BadRequest("input_ids must be a non-empty list of token ids (or a list of such lists).")
        bad = sorted({t for p in prompts for t in p if not 0 <= t < tok.vocab_size})
        if bad:
            raise BadRequest(
                f"input_ids holds token ids outside the vocabulary [0, {tok.vocab_size}): {bad[:5]}"
            )
    if any(len(p) == 0 for p in prompts):
        raise BadRequest("The input is empty: send at least one token.")
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(sps) != len(prompts):
        raise BadRequest("sampling_params must be an object, or a list of objects, one per prompt.")
    checked = [sampling_params(s, tok.vocab_size) for s in sps]
    try:
        params = [SamplingParams.from_dict(s) for s in checked]
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"Invalid sampling_params: {exc}") from exc
    check_context(prompts, params, lab.sargs["context_length"])
    return prompts, params, batched


def parse_logprobs(body: dict, prompts: list[list[int]]) -> list | None:
    """GenerateReqInput's return_logprob, logprob_start_len, top_logprobs_num (each one value or one per
    prompt) -> a LogprobRequest per prompt (None where not asked), or None when no prompt asks."""
    from ddtree_runtime.tiny_engine.logprobs import LogprobRequest

    def per_prompt(key: str, default: Any) -> list:
        value = body.get(key)
        if value is None:
            return [default] * len(prompts)
        if not isinstance(value, list):
            return [value] * len(prompts)
        if len(value) != len(prompts):
            raise BadRequest(f"{key} must be one value, or a list of one value per prompt.")
        return value

    asked, starts, tops = (per_prompt(k, d) for k, d in (("return_logprob", False), ("logprob_start_len", -1),
                                                          ("top_logprobs_num", 0)))
    out = []
    for prompt, ask, start, top in zip(prompts, asked, starts, tops, strict=True):
        if start > len(prompt):
            raise BadRequest(f"req.logprob_start_len={start} is higher than the number of input tokens "
                             f"len(req.origin_input_ids)={len(prompt)}. Please use a smaller "
                             "logprob_start_len.")
        out.append(LogprobRequest(start, max(top, 0)) if ask else None)
    return out if any(out) else None


def parse_tokenize(body: dict, lab: TinyServerView) -> dict:
    """SGLang's /tokenize (TokenizeRequest, prompt text or a list of texts): the ids /generate reads."""
    prompt = body.get("prompt")
    tok = lab.engine.tokenizer
    if isinstance(prompt, str):
        tokens: list = tok.encode(_unicode(prompt))
        count: int | list[int] = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        tokens = [tok.encode(_unicode(p)) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        raise BadRequest(f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")
    return {"tokens": tokens, "count": count, "max_model_len": lab.sargs["context_length"]}


def _unicode(text: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can encode: a 400, not a crash."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"The text is not valid Unicode: {exc.reason} at position {exc.start}.") from None
    return text


def check_context(prompts, params, context_length: int) -> None:
    for p, s in zip(prompts, params, strict=True):
        if len(p) + s.max_new_tokens > context_length:
            raise BadRequest(
                "Requested token count exceeds the model's maximum context length of "
                f"{context_length} tokens. You requested a total of {len(p) + s.max_new_tokens} tokens: "
                f"{len(p)} tokens from the input messages and {s.max_new_tokens} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the completion "
                "to fit within the limit."
            )


def parse_openai(body: dict, lab: TinyServerView, *, chat: bool) -> tuple[list[int], object]:
    from ddtree_runtime.tiny_engine.engine import SamplingParams

    tok = lab.engine.tokenizer
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the lab engine; send stream=false.")
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise BadRequest(f"n must be a positive integer, got {str(n)[:40]!r}.")
    if n not in (None, 1):
        raise BadRequest("n > 1 is not supported.")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} objects.")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
                raise BadRequest(f"each message needs a role of system/user/assistant/tool, got {m!r}")
            if not isinstance(m.get("content"), str):
                raise BadRequest("message content must be a string (no multimodal parts in the lab).")
        prompt = tok.encode(_unicode(tok.apply_chat_template(messages)))
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise BadRequest("prompt must be a non-empty string.")
        prompt = tok.encode(_unicode(text))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    raw = {
        "max_new_tokens": 128 if max_tokens is None else max_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "ignore_eos": body.get("ignore_eos"),
        "stop_token_ids": body.get("stop_token_ids"),
    }
    checked = sampling_params(raw, tok.vocab_size)
    try:
        params = SamplingParams.from_dict(checked)
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from exc
    check_context([prompt], [params], lab.sargs["context_length"])
    return prompt, params
