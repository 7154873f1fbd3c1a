"""`/tokenize`, `/detokenize` and `/tokenizer_info`: the served model's tokenizer over HTTP, in
the shapes vLLM serves and its clients read (lm-eval's `tokenizer_backend=remote`, for one,
probes `/tokenizer_info` for `eos_token` and tokenizes through `/tokenize`).

- `POST /tokenize`: `{"prompt": str, "add_special_tokens": bool = true}` or a chat
  `{"messages": [...], "add_generation_prompt": bool = true}` (the chat template, as chat
  completions render it) -> `{"count", "max_model_len", "tokens", "token_strs": null}`.
- `POST /detokenize`: `{"tokens": [int, ...]}` -> `{"prompt": str}`; ids outside the
  vocabulary are a 400.
- `GET /tokenizer_info`: the tokenizer's class, special tokens and chat template.

Like `/v1/*`, they need the API key when the server has one. Their work (tokenizing, the
chat template, `return_token_strs`' decoding) runs in a worker thread of their own pool
(`ServingContext.tokenize_pool`), never on the event loop and never in the pool that
tokenizes generation requests' prompts; a `/tokenize` prompt is held to the same character
cap as a completion's.
"""

from __future__ import annotations

import json

from pydantic import Field

from loopserve.errors import InvalidRequestError
from loopserve.server.api_errors import ApiError
from loopserve.server.protocol import _Request
from loopserve.server.protocol_chat import ChatMessage
from loopserve.server.serving_common import ServingContext, parse_body, process_text


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(_Request):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


def _tokenizer(ctx: ServingContext):
    tokenizer = ctx.tokenizer()
    if tokenizer is None:
        raise ApiError(400, "the served model has no tokenizer; send token ids instead")
    return tokenizer


async def tokenize(ctx: ServingContext, raw_body: bytes) -> dict[str, object]:
    try:
        parsed = json.loads(raw_body)
        is_chat = isinstance(parsed, dict) and "messages" in parsed
    except (ValueError, TypeError):
        is_chat = False  # parse_body reports the malformed body
    body: TokenizeCompletionRequest | TokenizeChatRequest = parse_body(
        raw_body, TokenizeChatRequest if is_chat else TokenizeCompletionRequest
    )
    ctx.check_model(body.model)
    tokenizer = _tokenizer(ctx)
    info = ctx.model_info()
    processor = ctx.input_processor()
    if isinstance(body, TokenizeChatRequest):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]

        def work() -> tuple[list[int], list[str] | None]:
            processed = processor.process_chat(
                messages, add_generation_prompt=body.add_generation_prompt
            )
            return _with_strs(tokenizer, list(processed.token_ids), body.return_token_strs)
    else:
        prompt, special = body.prompt, body.add_special_tokens
        # The character cap generation requests have: a text that cannot fit the context is
        # refused before it is tokenized (megabytes of it took the tokenizer seconds).
        try:
            processor.check_chars(len(prompt), "prompt")
        except InvalidRequestError as err:
            raise ApiError(400, err.message, param=err.param) from None

        def work() -> tuple[list[int], list[str] | None]:
            tokens = tokenizer.encode(prompt, add_special_tokens=special)
            return _with_strs(tokenizer, tokens, body.return_token_strs)

    tokens, strs = await process_text(work, ctx.tokenize_pool)
    return TokenizeResponse(
        count=len(tokens), max_model_len=info.max_model_len, tokens=tokens, token_strs=strs
    ).model_dump()


def _with_strs(tokenizer, tokens: list[int], wanted: bool) -> tuple[list[int], list[str] | None]:
    """The tokens and, when `wanted`, each one's text (decoded in the worker thread too)."""
    return tokens, [tokenizer.decode([t]) for t in tokens] if wanted else None


async def detokenize(ctx: ServingContext, raw_body: bytes) -> dict[str, object]:
    body = parse_body(raw_body, DetokenizeRequest)
    ctx.check_model(body.model)
    tokenizer = _tokenizer(ctx)
    vocab_size = tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(
            400, f"token ids must be in [0, {vocab_size}); got {bad[:5]}", param="tokens"
        )
    return {"prompt": await process_text(lambda: tokenizer.decode(body.tokens), ctx.tokenize_pool)}


def tokenizer_info(ctx: ServingContext) -> dict[str, object]:
    tokenizer = _tokenizer(ctx)
    info = ctx.model_info()
    return {
        "tokenizer_class": "loopserve.text.Tokenizer",
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": None,
        "eos_token_ids": list(tokenizer.eos_token_ids),
        "vocab_size": tokenizer.vocab_size,
        "chat_template": tokenizer.chat_template,
        "model_max_length": info.max_model_len,
    }
