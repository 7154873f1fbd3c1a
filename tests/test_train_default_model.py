"""The default model's training script runs end to end in a tiny configuration and writes a
checkpoint that the engine loads; its ShareGPT reader survives a file cut off mid-record."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from loopserve.eval.data import in_heldout, is_prose, iter_records, prose_conversations
from loopserve.llm import LLM
from loopserve.models import load_model
from loopserve.reference import generate as reference_generate
from loopserve.sampling_params import SamplingParams
from loopserve.text.tokenizer import SPECIAL_TOKENS, Tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "train_default_model.py"

SENTENCES = [
    "The river runs past the old mill and the children play by the water in the summer.",
    "A good plan starts with a clear goal, a short list of steps and a honest look at time.",
    "She walked to the market early in the morning to buy bread, apples and fresh flowers.",
    "Learning a new language takes patience, practice and a little courage to make mistakes.",
    "The team met on Monday to talk about the project and to decide what to do next week.",
]


def _load_script():
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def _write_sharegpt(path: Path, num_records: int) -> None:
    records = []
    for i in range(num_records):
        first, second = SENTENCES[i % 5], SENTENCES[(i + 2) % 5]
        records.append({"id": f"conv_{i}", "conversations": [
            {"from": "human", "value": f"Tell me something, please. {first}"},
            {"from": "gpt", "value": f"{second} {first}"},
            {"from": "human", "value": "def f(x): return {x: 1}  # code, dropped"},
            {"from": "gpt", "value": "```python\nprint(1)\n```"},
        ]})  # fmt: skip
    text = json.dumps(records, indent=1)
    path.write_text(text[: len(text) - 40])  # cut mid-record, like the bundled file


def test_sharegpt_reader_drops_the_truncated_tail_and_non_prose_turns(tmp_path):
    data = tmp_path / "sharegpt.json"
    _write_sharegpt(data, 6)
    assert [r["id"] for r in iter_records(data)] == [f"conv_{i}" for i in range(5)]
    conversations = prose_conversations(data)
    assert len(conversations) == 5
    assert all(len(c.messages) == 2 for c in conversations)  # the code pair is dropped
    assert conversations[0].messages[0]["role"] == "user"
    assert is_prose(SENTENCES[0]) and not is_prose("x = {1: 2} and more words here")
    assert not is_prose("caf\u00e9 au lait is a drink people like") and not is_prose("short")
    # The split is a stable CRC-32 of the id: zlib.crc32(b"conv_0") % 100 == 54.
    assert in_heldout("conv_0", 55) and not in_heldout("conv_0", 54)


def test_training_script_tiny_run_writes_a_checkpoint_the_engine_loads(tmp_path):
    data = tmp_path / "sharegpt.json"
    _write_sharegpt(data, 41)
    out = tmp_path / "ckpt"
    args = ["--out", str(out), "--data-file", str(data), "--heldout-percent", "30",
            "--vocab-size", "300", "--hidden-size", "32", "--num-layers", "2", "--num-heads", "2",
            "--num-kv-heads", "1", "--intermediate-size", "64", "--seq-len", "16",
            "--batch-size", "2", "--max-steps", "3", "--warmup-steps", "1", "--gate-warmup",
            "0.3", "--gate-ramp", "0.3", "--gate-steps", "2", "--val-windows", "2",
            "--eval-every-s", "1e9", "--seed", "5"]  # fmt: skip
    assert _load_script().main(args) == 0

    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == 3 and info["tokens"] == 3 * 2 * 16
    assert all(0.0 < ce < 10.0 for ce in info["val_ce_per_loop"])
    assert 1.0 <= info["val_mean_exit_loops"] <= 4.0
    model = load_model(out, dtype="float32")
    assert model.num_loops == 4 and model.config.vocab_size == 300
    tokenizer = Tokenizer.from_dir(out)
    assert [tokenizer.encode(t) for t in SPECIAL_TOKENS] == [[0], [1], [2]]
    assert tokenizer.eos_token_ids == (2, 0) and tokenizer.has_chat_template
    text = "The river runs past the old mill."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    out_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (result,) = LLM(str(out), dtype="float32", num_blocks=64, block_size=8).generate(
        ["Tell me something"], out_params, use_tqdm=False
    )
    # the trained checkpoint equals the dense oracle (tokens and loops: the default threshold
    # 1.0 runs all 4 loops per token)
    ref = reference_generate(load_model(out, dtype="float32"), result.prompt_token_ids, out_params)
    assert (result.token_ids, result.exit_depths) == (ref.token_ids, ref.exit_depths)
    assert result.exit_depths == [4] * 4

    # Gate-only phase from that checkpoint: only `early_exit_gate` may change.
    gated = tmp_path / "gated"
    gate_args = ["--out", str(gated), "--init-from", str(out), "--max-steps", "0",
                 "--gate-steps", "3", "--gate-entropy-beta", "0.0"]  # fmt: skip
    shared = args[args.index("--data-file") : args.index("--max-steps")]
    assert _load_script().main(gate_args + shared) == 0
    before, after = model.state_dict(), load_model(gated, dtype="float32").state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}
    assert json.loads((gated / "training.json").read_text())["steps"] == 0

    # A smaller vocabulary from that checkpoint: the looped layers and gate are copied, and
    # each token of the new BPE takes the embedding and lm_head rows of the same string.
    small = tmp_path / "small"
    small_args = ["--out", str(small), "--init-from", str(out), "--max-steps", "0",
                  "--vocab-size", "280"]  # fmt: skip
    shared_rest = shared[: shared.index("--vocab-size")] + shared[shared.index("--hidden-size") :]
    assert _load_script().main(small_args + shared_rest) == 0
    moved = load_model(small, dtype="float32").state_dict()
    assert moved["model.embed_tokens.weight"].shape == (280, 32)
    for name in ("model.layers.1.mlp.down_proj.weight", "model.early_exit_gate.weight"):
        assert torch.equal(moved[name], before[name])
    old_vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    new_vocab = json.loads((small / "tokenizer.json").read_text())["model"]["vocab"]
    shared_tokens = [t for t in new_vocab if t in old_vocab]
    assert len(shared_tokens) > 250  # the smaller BPE mostly repeats the larger one's merges
    for token in shared_tokens:
        new_id, old_id = new_vocab[token], old_vocab[token]
        assert torch.equal(moved["lm_head.weight"][new_id], before["lm_head.weight"][old_id])
        assert torch.equal(
            moved["model.embed_tokens.weight"][new_id], before["model.embed_tokens.weight"][old_id]
        )


def test_ouro_loss_matches_a_hand_computed_two_loop_case():
    module = _load_script()

    class TwoLoops(torch.nn.Module):
        # coda: logits are the hidden state itself; gate: sigmoid of its first entry.
        def coda(self, hidden):
            return hidden

        def gate(self, hidden):
            return torch.sigmoid(hidden[:, 0])

    logit = torch.log(torch.tensor(0.25 / 0.75))  # sigmoid(logit) = 0.25
    loop1 = torch.tensor([[logit, 0.0]])
    loop2 = torch.tensor([[0.0, 0.0]])
    target = torch.tensor([1])
    parts = module.ouro_loss(TwoLoops(), [loop1, loop2], target, gate_weight=1.0, beta=0.1,
                             last_loop_weight=0.5)  # fmt: skip
    ce1 = -torch.log_softmax(loop1, -1)[0, 1]
    ce2 = torch.log(torch.tensor(2.0))
    p1, p2 = 0.25, 0.75  # exit after loop 1 with the hazard; the last loop takes the rest
    entropy = -(p1 * torch.log(torch.tensor(p1)) + p2 * torch.log(torch.tensor(p2)))
    expected = p1 * ce1 + p2 * ce2 - 0.1 * entropy + 0.5 * ce2
    assert float(parts.loss) == pytest.approx(float(expected), abs=1e-6)
    assert parts.mean_exit_loops == pytest.approx(0.25 * 1 + 0.75 * 2)
    warm = module.ouro_loss(TwoLoops(), [loop1, loop2], target, gate_weight=0.0, beta=0.1,
                            last_loop_weight=0.0)  # fmt: skip
    assert float(warm.loss) == pytest.approx(float(0.5 * ce1 + 0.5 * ce2), abs=1e-6)
