"""Text in: one place that turns a prompt (or chat messages) into checked prompt token ids.

`InputProcessor.process` takes a prompt string or a list of token ids, `process_chat` a list of
chat messages (rendered with the model's chat template, then tokenized without extra special
tokens, since the template places them). Both return a `ProcessedPrompt`. Before any
tokenization, a prompt whose character length alone could not fit the context is rejected: a
vocabulary entry covers at most `Tokenizer.max_token_chars` characters, so more than
`max_model_len * max_token_chars` characters need more tokens than the context holds.

`check_request` applies the per-request limits that need the prompt length or live in text:
prompt + `max_tokens` within the context, and the stop-string limits (`MAX_STOP_STRINGS`
strings of at most `MAX_STOP_STRING_CHARS` characters in all).

The processor holds no per-request state and only reads the tokenizer, so it is safe to call
from several threads at once: the server runs it in worker threads (the `tokenizers` backend
releases the GIL for long texts), never on its event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loopserve.errors import CapacityError, InvalidRequestError
from loopserve.sampling_params import SamplingParams
from loopserve.text.structured import StructuredOutputs
from loopserve.text.tokenizer import Tokenizer

# At most this many stop strings per request, with at most this many characters in all. Each
# output token is checked against every stop string's possible prefixes, so these bound the
# engine thread's text work per token (vLLM has no limit; OpenAI allows 4 strings).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 2048


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A checked prompt: its text (None when given as token ids) and its token ids."""

    text: str | None
    token_ids: list[int]


class InputProcessor:
    """Validates and tokenizes prompts for one model; see the module docstring."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        *,
        vocab_size: int,
        max_model_len: int,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.structured = structured  # checks structured-output constraints (a tokenizer's)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        max_token_chars = tokenizer.max_token_chars if tokenizer is not None else 1
        # A prompt needs one position for itself and leaves one for the first output token.
        self.max_prompt_chars = (max_model_len - 1) * max(1, max_token_chars)

    def process(self, prompt: str | list[int] | ProcessedPrompt) -> ProcessedPrompt:
        """Tokenize a string (adding BOS when the model wants it) or check token ids."""
        if isinstance(prompt, ProcessedPrompt):
            self._check_token_ids(prompt.token_ids)
            return prompt
        if isinstance(prompt, str):
            tokenizer = self._require_tokenizer("prompt", "pass prompt token ids")
            self.check_chars(len(prompt), "prompt")
            token_ids = tokenizer.encode(prompt, add_special_tokens=True)
            self._check_token_ids(token_ids)
            return ProcessedPrompt(prompt, token_ids)
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        token_ids = list(prompt)
        self._check_token_ids(token_ids)
        return ProcessedPrompt(None, token_ids)

    def process_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> ProcessedPrompt:
        """Render `messages` with the chat template and tokenize the result (text in a
        message that spells a special token stays plain text: `Tokenizer.encode_chat`)."""
        tokenizer = self._require_tokenizer("messages", "use /v1/completions instead")
        if not tokenizer.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions instead", "messages"
            )
        if isinstance(messages, list):
            content_chars = sum(
                len(m["content"])
                for m in messages
                if isinstance(m, dict) and isinstance(m.get("content"), str)
            )
            self.check_chars(content_chars, "messages")
        text, token_ids = tokenizer.encode_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            check_text=lambda text: self.check_chars(len(text), "messages"),
            tools=tools,
        )
        self._check_token_ids(token_ids, param="messages")
        return ProcessedPrompt(text, token_ids)

    def check_request(self, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        """Prompt + `max_tokens` must fit the context; stop strings within their limits;
        `logit_bias` names tokens of the vocabulary; a structured-output constraint compiles."""
        check_stop_strings(params.stop)
        if params.structured_output is not None:
            if self.structured is None:
                raise InvalidRequestError(
                    "structured output needs the model's tokenizer; this model has none",
                    param="response_format",
                )
            self.structured.check(params.structured_output)
        outside = [token for token, _ in params.logit_bias if token >= self.vocab_size]
        if outside:
            raise InvalidRequestError(
                f"logit_bias names token ids outside the vocabulary ({self.vocab_size} tokens): "
                f"{outside[:5]}",
                param="logit_bias",
            )
        num_prompt_tokens = len(prompt.token_ids)
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise CapacityError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds the maximum context length {self.max_model_len}",
                param="max_tokens",
            )

    def _require_tokenizer(self, param: str, instead: str) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError(f"this model has no tokenizer; {instead}", param)
        return self.tokenizer

    def check_chars(self, num_chars: int, param: str) -> None:
        """`CapacityError` for a text whose character count alone cannot fit the context
        (checked before tokenizing it)."""
        if num_chars > self.max_prompt_chars:
            raise CapacityError(
                f"the prompt has {num_chars} characters; it cannot fit the maximum context "
                f"length of {self.max_model_len} tokens (at most {self.max_prompt_chars} "
                "characters with this tokenizer)",
                param=param,
            )

    def _check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise InvalidRequestError("prompt must contain at least one token", param)
        if len(token_ids) >= self.max_model_len:
            raise CapacityError(
                f"the prompt has {len(token_ids)} tokens; the maximum context length is "
                f"{self.max_model_len}, and at least one output token must fit",
                param=param,
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}", param
            )


def check_stop_strings(stop: tuple[str, ...]) -> None:
    """Raise InvalidRequestError (param "stop") unless `stop` is within the stop-string limits."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"too many stop strings: {len(stop)}; at most {MAX_STOP_STRINGS} are allowed", "stop"
        )
    num_chars = sum(len(s) for s in stop)
    if num_chars > MAX_STOP_STRING_CHARS:
        raise InvalidRequestError(
            f"stop strings have {num_chars} characters in all; at most {MAX_STOP_STRING_CHARS} "
            "are allowed",
            "stop",
        )


__all__ = [
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "InputProcessor",
    "ProcessedPrompt",
    "check_stop_strings",
]
