"""What the completions and chat handlers write of an output besides its text: usage
(with the loops the tokens used), token text, OpenAI and vLLM log-probability shapes, prompt
tokens' exit depths, and the log-probabilities a streamed step adds.
"""

from __future__ import annotations

from loopserve.outputs import RequestOutput, TokenLogprob
from loopserve.server.protocol import (
    CompletionLogprobs,
    CompletionTokensDetails,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    UsageInfo,
)
from loopserve.text.tokenizer import Tokenizer


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    reasoning_tokens: int | None = None,
    loops: int | None = None,
) -> UsageInfo:
    """`reasoning_tokens` (with a reasoning parser): the output tokens of the reasoning;
    `loops`: the loops all output tokens used (the sum of their exit depths)."""
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        completion_tokens_details=None
        if reasoning_tokens is None
        else CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
        completion_loops=loops,
        mean_loops=None
        if loops is None
        else (loops / completion_tokens if completion_tokens else 0.0),
    )


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """One token as text; `token_id:N` when the model has no tokenizer."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer | None, entries: list[TokenLogprob], text_offset: int
) -> CompletionLogprobs:
    """OpenAI completions logprobs; offsets count characters from `text_offset`."""
    result = CompletionLogprobs()
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append(
            {token_text(tokenizer, t): lp for t, lp in entry.top_logprobs} or None
        )
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


def vllm_prompt_logprobs(
    tokenizer: Tokenizer | None, output: RequestOutput, top: int | None
) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` of `output` when the request asked (`top`): None for the first
    prompt token, then per token a dict of it and the `top` most likely tokens (by id)."""
    if top is None or output.prompt_logprobs is None:
        return None
    result: PromptLogprobs = [None]
    for entry in output.prompt_logprobs[1:]:
        assert entry is not None  # only the first prompt token has no score
        scored = {
            str(entry.token_id): PromptLogprob(
                logprob=entry.logprob,
                rank=entry.rank,
                decoded_token=token_text(tokenizer, entry.token_id),
            )
        }
        for rank, (token_id, logprob) in enumerate(entry.top_logprobs[:top], start=1):
            scored.setdefault(
                str(token_id),
                PromptLogprob(
                    logprob=logprob, rank=rank, decoded_token=token_text(tokenizer, token_id)
                ),
            )
        result.append(scored)
    return result


def prompt_exit_depths(output: RequestOutput) -> list[int | None] | None:
    """Per prompt token, the loop whose output scored it (None for the first); None when
    the prompt was not scored."""
    if output.prompt_logprobs is None:
        return None
    return [None, *(entry.loops for entry in output.prompt_logprobs[1:] if entry is not None)]


def new_logprobs(output: RequestOutput) -> list[TokenLogprob]:
    """The logprobs of this step's new tokens."""
    if output.logprobs is None or not output.new_token_ids:
        return []
    if output.output_kind == "delta":
        return output.logprobs
    return output.logprobs[len(output.token_ids) - len(output.new_token_ids) :]
