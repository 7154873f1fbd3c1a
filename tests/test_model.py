"""The Ouro model: loading, attention semantics, per-row-depth core calls."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopserve.errors import ModelLoadError
from loopserve.models import load_model, save_model
from loopserve.models.attention import DenseAttention, DenseKV, attention_reference
from loopserve.models.tiny import make_tiny_checkpoint


def full_forward_logits(model, token_ids: list[int]) -> list[torch.Tensor]:
    """Logits of every loop over the whole sequence, in one dense pass per loop."""
    config = model.config
    kv = DenseKV(
        num_planes=model.num_loops,
        num_layers=config.num_hidden_layers,
        max_len=len(token_ids),
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=torch.float32,
    )
    positions = torch.arange(len(token_ids))
    hidden = model.prelude(torch.tensor(token_ids))
    logits = []
    for depth in range(model.num_loops):
        attn = DenseAttention(kv, depth, positions, config.head_dim**-0.5)
        hidden = model.core(hidden, positions, attn)
        logits.append(model.coda(hidden))
    return logits


def test_save_then_load_round_trip_gives_identical_logits(tiny_model, tmp_path):
    save_model(tiny_model, tmp_path / "copy")
    copy = load_model(tmp_path / "copy", dtype="float32")
    tokens = [5, 17, 300, 2, 99]
    for a, b in zip(full_forward_logits(tiny_model, tokens), full_forward_logits(copy, tokens)):
        assert torch.equal(a, b)


def test_sharded_checkpoint_loads_to_the_same_weights(tiny_dir, tiny_model, tmp_path):
    sharded = make_tiny_checkpoint(tmp_path / "sharded", seed=0, max_shard_bytes=40_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = load_model(sharded, dtype="float32")
    for name, tensor in tiny_model.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_missing_tensor_is_named_in_the_error(tiny_dir, tmp_path):
    target = make_tiny_checkpoint(tmp_path / "broken", seed=0)
    tensors = load_file(str(target / "model.safetensors"))
    del tensors["model.layers.1.input_layernorm_2.weight"]
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensors: model.layers.1.input_layernorm_2"):
        load_model(target, dtype="float32")


def test_unexpected_tensor_is_named_in_the_error(tmp_path):
    target = make_tiny_checkpoint(tmp_path / "extra", seed=0)
    tensors = load_file(str(target / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match="unexpected tensors: model.layers.0.self_attn.q_proj.bias"
    ):
        load_model(target, dtype="float32")


def test_wrong_model_type_and_unknown_hub_id_give_clear_errors(tmp_path, monkeypatch):
    target = make_tiny_checkpoint(tmp_path / "llama", seed=0)
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = "llama"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model_type 'llama'"):
        load_model(target)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.delenv("LOOPSERVE_ALLOW_DOWNLOAD", raising=False)
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        load_model("ByteDance/Ouro-1.4B")


def test_hub_id_resolves_through_the_local_cache(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--acme--tiny-ouro"
    make_tiny_checkpoint(repo / "snapshots" / "abc123", seed=0)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = load_model("acme/tiny-ouro", dtype="float32")
    assert model.config.num_hidden_layers == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_load_in_each_dtype(tiny_dir, dtype):
    model = load_model(tiny_dir, dtype=dtype)
    assert model.lm_head.weight.dtype == getattr(torch, dtype)
    logits = full_forward_logits(model.float(), [1, 2, 3])[-1]
    assert torch.isfinite(logits).all()


def test_worked_example_last_exited_reads_loop_zero_version():
    # Per-depth KV (LAST_EXITED): A has (k,v)=(1,10) at loop 0 and (2,20) at loop 1; B at loop 0 has q=k=1, v=30.
    kv = DenseKV(
        num_planes=2, num_layers=1, max_len=2, num_kv_heads=1, head_dim=1, dtype=torch.float64
    )
    kv.key[0, 0, 0], kv.value[0, 0, 0] = 1.0, 10.0
    kv.key[1, 0, 0], kv.value[1, 0, 0] = 2.0, 20.0
    b = torch.tensor([[[1.0]]], dtype=torch.float64)
    attn = DenseAttention(kv, 0, torch.tensor([1]), scale=1.0)
    out = attn.attend(0, b, b, torch.tensor([[[30.0]]], dtype=torch.float64))
    assert out.item() == pytest.approx(20.0)


def test_worked_example_shared_reads_final_version():
    kv = DenseKV(
        num_planes=1, num_layers=1, max_len=2, num_kv_heads=1, head_dim=1, dtype=torch.float64
    )
    kv.key[0, 0, 0], kv.value[0, 0, 0] = 1.0, 10.0
    kv.key[0, 0, 0], kv.value[0, 0, 0] = 2.0, 20.0  # loop 1 overwrites loop 0
    b = torch.tensor([[[1.0]]], dtype=torch.float64)
    attn = DenseAttention(kv, 0, torch.tensor([1]), scale=1.0)
    out = attn.attend(0, b, b, torch.tensor([[[30.0]]], dtype=torch.float64))
    expected = (math.e**2 * 20 + math.e * 30) / (math.e**2 + math.e)
    assert out.item() == pytest.approx(expected)
    assert out.item() == pytest.approx(22.69, abs=0.005)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 8, generator=gen)
    k = torch.randn(7, 2, 8, generator=gen)
    v = torch.randn(7, 2, 8, generator=gen)
    allowed = torch.arange(7).unsqueeze(0) <= torch.arange(2, 7).unsqueeze(1)
    gqa = attention_reference(q, k, v, allowed, 0.3)
    mha = attention_reference(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), allowed, 0.3
    )
    torch.testing.assert_close(gqa, mha, rtol=0, atol=0)
    # Query head h uses KV head h // 2.
    single = attention_reference(q[:, 3:4], k[:, 1:2], v[:, 1:2], allowed, 0.3)
    torch.testing.assert_close(gqa[:, 3:4], single)


def test_per_row_depth_core_call_equals_running_rows_separately(tiny_model):
    config = tiny_model.config

    def fresh_kv():
        kv = DenseKV(num_planes=4, num_layers=config.num_hidden_layers, max_len=8,
                     num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                     dtype=torch.float32)  # fmt: skip
        gen = torch.Generator().manual_seed(1)
        kv.key.copy_(torch.randn(kv.key.shape, generator=gen))
        kv.value.copy_(torch.randn(kv.value.shape, generator=gen))
        return kv

    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, config.hidden_size, generator=gen)
    positions = torch.tensor([5, 3, 7])
    planes = [0, 2, 3]
    scale = config.head_dim**-0.5
    kv = fresh_kv()
    batched = tiny_model.core(hidden, positions, DenseAttention(kv, planes, positions, scale))
    for row in range(3):
        kv_row = fresh_kv()
        attn = DenseAttention(kv_row, planes[row], positions[row : row + 1], scale)
        alone = tiny_model.core(hidden[row : row + 1], positions[row : row + 1], attn)
        torch.testing.assert_close(batched[row : row + 1], alone, rtol=1e-5, atol=1e-5)


def test_four_norms_and_loop_norm_follow_the_ouro_layer_math(tiny_model):
    """Re-derive one loop by hand from the checkpoint tensors."""
    sd = tiny_model.state_dict()
    config = tiny_model.config
    tokens = torch.tensor([3, 1, 4, 1, 5])
    n, heads, kvh, hd = (
        len(tokens),
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    inv = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(n).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(x):
        return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

    h = sd["model.embed_tokens.weight"][tokens]
    for _loop in range(2):
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            x = rms(h, sd[p + "input_layernorm.weight"])
            q = rope((x @ sd[p + "self_attn.q_proj.weight"].T).view(n, heads, hd))
            k = rope((x @ sd[p + "self_attn.k_proj.weight"].T).view(n, kvh, hd))
            v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(n, kvh, hd)
            k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
            s = s.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
            a = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, heads * hd)
            h = h + rms(a @ sd[p + "self_attn.o_proj.weight"].T, sd[p + "input_layernorm_2.weight"])
            x = rms(h, sd[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(x @ sd[p + "mlp.gate_proj.weight"].T)
            m = (gate * (x @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
            h = h + rms(m, sd[p + "post_attention_layernorm_2.weight"])
        h = rms(h, sd["model.norm.weight"])
    expected_logits = h @ sd["lm_head.weight"].T
    expected_gate = torch.sigmoid(
        h @ sd["model.early_exit_gate.weight"].T + sd["model.early_exit_gate.bias"]
    )
    logits = full_forward_logits(tiny_model, tokens.tolist())[1]
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    kv = DenseKV(num_planes=2, num_layers=config.num_hidden_layers, max_len=n,
                 num_kv_heads=kvh, head_dim=hd, dtype=torch.float32)  # fmt: skip
    hidden = tiny_model.prelude(tokens)
    for loop in range(2):
        hidden = tiny_model.core(
            hidden, torch.arange(n), DenseAttention(kv, loop, torch.arange(n), hd**-0.5)
        )
    torch.testing.assert_close(
        tiny_model.gate(hidden), expected_gate.squeeze(-1), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("lookahead", [False, True], ids=["trained_gate", "lookahead_head"])
def test_hazards_are_float32_for_a_bfloat16_model(tiny_dir, lookahead):
    from loopserve.models.ouro import make_hazard_fn, make_lookahead_head

    model = load_model(tiny_dir, dtype="bfloat16")
    hidden = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    hidden = hidden.to(torch.bfloat16)
    hazard_fn = make_hazard_fn(model, lookahead_seed=5 if lookahead else None)
    head = make_lookahead_head(model, 5) if lookahead else model.model.early_exit_gate
    hazards = hazard_fn(hidden)
    assert hazards.dtype == torch.float32
    # Independent: the same bf16 weights and inputs in float64.
    logits = hidden.double() @ head.weight.double().T + head.bias.double()
    expected = torch.sigmoid(logits.squeeze(-1))
    torch.testing.assert_close(hazards.double(), expected, atol=1e-6, rtol=0)
    # The bf16 gate it replaces rounds hazards well past that tolerance.
    rounded = torch.sigmoid(head(hidden).squeeze(-1)).double()
    assert (rounded - expected).abs().max() > 1e-4


def test_merged_projections_keep_names_and_equal_separate_gemms(tiny_dir):
    """On CUDA the loader merges Ouro's q/k/v and gate/up into one GEMM each (on CPU not:
    slower there): the published tensor names stay (views of the merged weights, no second
    copy) and the logits equal the separate projections' (float32, up to GEMM rounding)."""
    model = load_model(tiny_dir, dtype="float32")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_weight is None and mlp.gate_up_weight is None  # CPU: kept apart
    model.merge_projections()
    names = set(load_file(str(tiny_dir / "model.safetensors")))
    assert set(model.state_dict()) == names
    assert attn.qkv_weight is not None and mlp.gate_up_weight is not None
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.qkv_weight.data_ptr()
    assert torch.equal(mlp.up_proj.weight, mlp.gate_up_weight[mlp.gate_proj.weight.shape[0] :])
    merged = full_forward_logits(model, [5, 9, 2, 7])
    model.make_rows_invariant()  # back to one GEMM per projection
    assert attn.qkv_weight is None and mlp.gate_up_weight is None
    separate = full_forward_logits(model, [5, 9, 2, 7])
    for a, b in zip(merged, separate):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_loading_each_family_skips_initialisation_and_imports_no_compiler(tiny_dir, tmp_path):
    """A model is built on the meta device and receives the checkpoint's tensors; the modules'
    random fills are skipped, since on meta tensors they import torch._dynamo, about one
    CPU-second in every process that loads a model (each Ray replica, each CLI run)."""
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
    from loopserve.models.momentum_tiny import make_tiny_momentum_checkpoint

    directories = [
        tiny_dir,
        make_tiny_huginn_checkpoint(tmp_path / "huginn"),
        make_tiny_momentum_checkpoint(tmp_path / "momentum"),
    ]
    code = (
        "import sys; from loopserve.models import load_model\n"
        "for d in sys.argv[1:]: load_model(d, dtype='float32')\n"
        "print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, directories)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "False", done.stdout + done.stderr


def test_initialisation_is_skipped_only_for_meta_tensors():
    from loopserve.models.loader import _SkipInitialisation

    real = torch.zeros(64)
    with torch.device("meta"), _SkipInitialisation():
        layer = torch.nn.Linear(4, 4)
        torch.nn.init.normal_(real)
        real.uniform_(1.0, 2.0)
    assert layer.weight.is_meta
    assert bool((real >= 1.0).all()) and bool((real <= 2.0).all())
