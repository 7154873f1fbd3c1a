"""Teacher-forced scoring of an Ouro model: every loop's output for whole sequences.

Every position runs all D loops, as the engine runs prompt positions, with causal attention
over the same loop's K/V of earlier positions (the LAST_EXITED plane of that depth). From the
D loop outputs this room derives per-loop log-probabilities of the next token and the gate's
hazards; `loopserve.eval.quality` picks a loop per position with the engine's exit rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loopserve.models.ouro import OuroForLoopedLM


class CausalBatchAttention:
    """Dense causal attention for `batch` equal-length sequences flattened to rows.

    Rows are sequence-major ([batch * seq_len]); row i of a sequence attends to rows 0..i of
    the same sequence in the same loop. Nothing is stored between calls.
    """

    def __init__(self, batch: int, seq_len: int) -> None:
        self.batch, self.seq_len = batch, seq_len

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        del layer_idx  # no cache: every loop attends within its own call
        shape = (self.batch, self.seq_len)
        q = query.view(*shape, *query.shape[1:]).transpose(1, 2)  # [B, Hq, S, Dh]
        k = key.view(*shape, *key.shape[1:]).transpose(1, 2)  # [B, Hkv, S, Dh]
        v = value.view(*shape, *value.shape[1:]).transpose(1, 2)
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(query.shape)  # [B*S, Hq, Dh]


def loop_outputs(
    model: OuroForLoopedLM,
    token_ids: torch.Tensor,
    attention_cls: type[CausalBatchAttention] = CausalBatchAttention,
) -> list[torch.Tensor]:
    """Normed output of every loop for token_ids [B, S]: D tensors [B*S, hidden]."""
    batch, seq_len = token_ids.shape
    device = model.lm_head.weight.device
    token_ids = token_ids.to(device)
    positions = torch.arange(seq_len, device=device).repeat(batch)  # [B*S]
    attn = attention_cls(batch, seq_len)
    hidden = model.prelude(token_ids.reshape(-1))
    outputs = []
    for _ in range(model.num_loops):
        hidden = model.core(hidden, positions, attn)
        outputs.append(hidden)
    return outputs


@dataclass(frozen=True)
class SequenceScores:
    """Per-position scores of sequences: the token at position t+1 given positions 0..t.

    `target_logprobs` [D, N] log p(target | loop d); `hazards` [D, N] gate of loop d;
    N counts the scored positions of all sequences (seq_len - 1 each).
    """

    target_logprobs: torch.Tensor
    hazards: torch.Tensor


@torch.inference_mode()
def score_sequences(model: OuroForLoopedLM, token_ids: torch.Tensor) -> SequenceScores:
    """Teacher-forced per-loop log-probabilities and hazards for token_ids [B, S]."""
    token_ids = token_ids.to(torch.int64)
    outputs = loop_outputs(model, token_ids[:, :-1])
    targets = token_ids[:, 1:].reshape(-1).to(model.lm_head.weight.device)
    logprobs, hazards = [], []
    for hidden in outputs:
        log_softmax = torch.log_softmax(model.coda(hidden).float(), dim=-1)  # [N, V]
        logprobs.append(log_softmax.gather(1, targets.unsqueeze(1)).squeeze(1))
        hazards.append(model.gate(hidden).float())
    return SequenceScores(torch.stack(logprobs).cpu(), torch.stack(hazards).cpu())
