"""Layer-level checks: rotary (incl. Llama-3.1 and linear scaling, both config spellings) and RMSNorm
against HF's own code; the tensor-parallel layers at TP=1 against plain torch; and, with the TP rank
and size simulated in this one process, that every rank's shard is the right slice of the full
checkpoint tensor and that the per-rank results combine (sum for row-parallel, concatenation for
column-parallel, masked sum for the embedding) into exactly the unsharded result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from actors import parallel_state
from actors.forward_context import ForwardContext, set_forward_context
from actors.layers.activation import SiluAndMul
from actors.layers.attention import Attention
from actors.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from actors.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from actors.layers.norm import RMSNorm
from actors.layers.rotary import RotaryEmbedding, inverse_frequencies, rope_params_from_config
from actors.layers.weight_utils import ShardShapeError

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rotary_matches_hf(kind: str, head_dim: int) -> None:
    hf_cfg = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rope_parameters=dict(ROPES[kind]),
    )
    hf_rope = LlamaRotaryEmbedding(hf_cfg)
    ours = RotaryEmbedding(head_dim, 1024, rope_params_from_config(hf_cfg.to_dict()))
    assert ours.cos_sin_cache.shape == (1024, head_dim)
    assert torch.equal(inverse_frequencies(head_dim, rope_params_from_config(hf_cfg.to_dict())), hf_rope.inv_freq)
    positions = torch.tensor([0, 1, 5, 63, 64, 100, 511, 1023, 7])
    q, k = randn(len(positions), 4, head_dim), randn(len(positions), 2, head_dim)
    cos, sin = hf_rope(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = ours(positions, q.reshape(len(positions), -1), k.reshape(len(positions), -1))
    torch.testing.assert_close(q_out.view_as(q), q_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out.view_as(k), k_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_rope_config_spellings_and_errors() -> None:
    # Published Llama-3.1 checkpoints: top-level rope_theta plus rope_scaling with "rope_type".
    old = {
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    new = {"rope_parameters": dict(old["rope_scaling"], rope_theta=500000.0)}
    assert rope_params_from_config(old) == rope_params_from_config(new)
    assert rope_params_from_config({"rope_scaling": {"type": "linear", "factor": 2.0}}).factor == 2.0
    assert rope_params_from_config({}).theta == 10000.0
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        rope_params_from_config({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        rope_params_from_config({"partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="requires 'low_freq_factor'"):
        rope_params_from_config({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype: torch.dtype) -> None:
    ref = LlamaRMSNorm(48, eps=1e-5)
    ours = RMSNorm(48, 1e-5, dtype)
    weight = 1 + 0.1 * randn(48)
    with torch.no_grad():
        ref.weight.copy_(weight)
    ref = ref.to(dtype)
    ours.weight.weight_loader(ours.weight, weight)
    x, res = randn(7, 48).to(dtype), randn(7, 48).to(dtype)
    assert torch.equal(ours(x), ref(x))
    out, new_res = ours(x, res)
    assert torch.equal(new_res, x + res)
    assert torch.equal(out, ref(x + res))


def test_silu_and_mul() -> None:
    x = randn(5, 12)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :6]) * x[:, 6:])


def test_linears_at_tp1() -> None:
    w, b = randn(12, 8), randn(12)
    x = randn(3, 8)
    col = ColumnParallelLinear(8, 12, True, torch.float32)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    torch.testing.assert_close(col(x), F.linear(x, w, b))

    row = RowParallelLinear(8, 12, True, torch.float32)
    row.weight.weight_loader(row.weight, randn(12, 8))
    row.bias.weight_loader(row.bias, b)
    torch.testing.assert_close(row(x), F.linear(x, row.weight, b))

    gate, up = randn(6, 8), randn(6, 8)
    merged = MergedColumnParallelLinear(8, [6, 6], False, torch.float32)
    merged.weight.weight_loader(merged.weight, up, 1)
    merged.weight.weight_loader(merged.weight, gate, 0)
    torch.testing.assert_close(merged(x), F.linear(x, torch.cat([gate, up])))

    q, k, v = randn(16, 8), randn(8, 8), randn(8, 8)
    qkv = QKVParallelLinear(8, 4, 4, 2, False, torch.float32)
    for shard_id, t in (("v", v), ("q", q), ("k", k)):
        qkv.weight.weight_loader(qkv.weight, t, shard_id)
    out_q, out_k, out_v = qkv.split(qkv(x))
    for got, t in ((out_q, q), (out_k, k), (out_v, v)):
        torch.testing.assert_close(got, F.linear(x, t))


def test_weight_loader_rejects_wrong_full_shape() -> None:
    qkv = QKVParallelLinear(8, 4, 4, 2, False, torch.float32)
    with pytest.raises(ShardShapeError, match=r"expected shape \(8, 8\), got \(12, 8\)"):
        qkv.weight.weight_loader(qkv.weight, randn(12, 8), "k")
    with pytest.raises(ValueError, match="shard_id='x'"):
        qkv.weight.weight_loader(qkv.weight, randn(8, 8), "x")
    row = RowParallelLinear(8, 12, False, torch.float32)
    with pytest.raises(ShardShapeError, match=r"expected shape \(12, 8\), got \(8, 12\)"):
        row.weight.weight_loader(row.weight, randn(8, 12))


@pytest.fixture
def simulate_tp(monkeypatch):
    """Set this process's TP rank/size; collectives become identities (the test combines ranks)."""
    monkeypatch.setattr(parallel_state, "all_reduce", lambda x: x)
    monkeypatch.setattr(parallel_state, "all_gather", lambda x, dim=-1: x)

    def set_rank(rank: int, world: int) -> None:
        monkeypatch.setattr(parallel_state, "_RANK", rank)
        monkeypatch.setattr(parallel_state, "_WORLD", world)

    return set_rank


def _as_slice(tmp_path, name: str, tensor: torch.Tensor):
    """The way the loader hands tensors over: a lazy safetensors slice."""
    path = str(tmp_path / f"{name}.safetensors")
    save_file({name: tensor.contiguous()}, path)
    return safe_open(path, framework="pt").get_slice(name)


@pytest.mark.parametrize("world", [2, 4])
def test_column_and_row_shards_combine(simulate_tp, tmp_path, world: int) -> None:
    w_col, b_col, w_row, b_row = randn(16, 8), randn(16), randn(8, 16), randn(8)
    x = randn(3, 8)
    col_parts, row_parts = [], []
    for rank in range(world):
        simulate_tp(rank, world)
        col = ColumnParallelLinear(8, 16, True, torch.float32)
        col.weight.weight_loader(col.weight, _as_slice(tmp_path, "wc", w_col))
        col.bias.weight_loader(col.bias, b_col)
        n = 16 // world
        assert torch.equal(col.weight, w_col[rank * n : (rank + 1) * n])
        col_out = col(x)
        col_parts.append(col_out)
        row = RowParallelLinear(16, 8, True, torch.float32)
        row.weight.weight_loader(row.weight, _as_slice(tmp_path, "wr", w_row))
        row.bias.weight_loader(row.bias, b_row)
        assert torch.equal(row.weight, w_row[:, rank * n : (rank + 1) * n])
        row_parts.append(row(col_out) - b_row)  # identity all-reduce: each rank adds the bias once
    full_col = torch.cat(col_parts, dim=-1)
    torch.testing.assert_close(full_col, F.linear(x, w_col, b_col))
    torch.testing.assert_close(sum(row_parts) + b_row, F.linear(full_col, w_row, b_row))


def test_merged_column_shards(simulate_tp) -> None:
    gate, up = randn(8, 4), randn(8, 4)
    for rank in range(2):
        simulate_tp(rank, 2)
        m = MergedColumnParallelLinear(4, [8, 8], False, torch.float32)
        m.weight.weight_loader(m.weight, gate, 0)
        m.weight.weight_loader(m.weight, up, 1)
        rows = slice(rank * 4, rank * 4 + 4)
        assert torch.equal(m.weight, torch.cat([gate[rows], up[rows]]))


@pytest.mark.parametrize("heads,kv_heads,world", [(8, 4, 2), (8, 2, 4), (8, 2, 8), (4, 4, 4)])
def test_qkv_shards_and_kv_replication(simulate_tp, tmp_path, heads: int, kv_heads: int, world: int) -> None:
    d, hidden = 4, 8
    q, k, v = randn(heads * d, hidden), randn(kv_heads * d, hidden), randn(kv_heads * d, hidden)
    bq, bk, bv = randn(heads * d), randn(kv_heads * d), randn(kv_heads * d)
    for rank in range(world):
        simulate_tp(rank, world)
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, True, torch.float32)
        for shard_id, w, b in (("q", q, bq), ("k", k, bk), ("v", v, bv)):
            layer.weight.weight_loader(layer.weight, _as_slice(tmp_path, "w" + shard_id, w), shard_id)
            layer.bias.weight_loader(layer.bias, b, shard_id)
        hq, hkv = heads // world, max(1, kv_heads // world)
        assert (layer.num_heads, layer.num_kv_heads) == (hq, hkv)
        kv_head = rank * kv_heads // world  # vLLM's mapping: consecutive ranks share a replicated head
        kv_rows = slice(kv_head * d, (kv_head + hkv) * d)
        q_rows = slice(rank * hq * d, (rank + 1) * hq * d)
        expected = torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
        assert torch.equal(layer.weight, expected)
        assert torch.equal(layer.bias, torch.cat([bq[q_rows], bk[kv_rows], bv[kv_rows]]))


def test_qkv_rejects_incompatible_tp(simulate_tp) -> None:
    simulate_tp(0, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must be a multiple of num_key_value_heads=3"):
        QKVParallelLinear(8, 4, 8, 3, False, torch.float32)
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tensor_parallel_size=4"):
        QKVParallelLinear(8, 4, 6, 2, False, torch.float32)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_vocab_parallel_embedding_and_lm_head(simulate_tp, tmp_path, world: int) -> None:
    vocab, dim = 301, 8
    table = randn(vocab, dim)
    ids = torch.tensor([0, 1, 75, 76, 151, 226, 300, 299, 150])
    hidden = randn(4, dim)
    emb_sum, logit_parts = 0, []
    for rank in range(world):
        simulate_tp(rank, world)
        emb = VocabParallelEmbedding(vocab, dim, torch.float32)
        emb.weight.weight_loader(emb.weight, _as_slice(tmp_path, "emb", table))
        per = -(-vocab // world)
        n = max(0, min(per, vocab - rank * per))
        assert torch.equal(emb.weight[:n], table[rank * per : rank * per + n])
        assert not emb.weight[n:].any(), "padding rows must be zero"
        emb_sum = emb_sum + emb(ids)
        head = ParallelLMHead(vocab, dim, torch.float32)
        head.weight.weight_loader(head.weight, table)
        logit_parts.append(head(hidden))
    torch.testing.assert_close(emb_sum, F.embedding(ids, table))
    # all_gather concatenates the per-rank slices; logits() then drops the padding columns.
    full = torch.cat(logit_parts, dim=-1)[..., :vocab] if world > 1 else logit_parts[0]
    torch.testing.assert_close(full, hidden @ table.T)
    assert logit_parts[0].dtype == torch.float32


def test_attention_layer_errors() -> None:
    with pytest.raises(ValueError, match="attention_backend='cuda'"):
        Attention("l0", 4, 2, 8, 0.3, backend="cuda")
    with pytest.raises(ValueError, match="sliding_window=0"):
        Attention("l0", 4, 2, 8, 0.3, sliding_window=0)
    attn = Attention("l0", 4, 2, 8, 0.3)
    q, kv = randn(3, 32), randn(3, 16)
    with pytest.raises(RuntimeError, match="outside set_forward_context"):
        attn(q, kv, kv)
    from actors.forward_context import AttentionMetadata

    md = AttentionMetadata(
        3,
        1,
        3,
        3,
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([3], dtype=torch.int32),
        torch.ones(1, 1, dtype=torch.int32),
        torch.arange(3),
    )
    with set_forward_context(ForwardContext({0: md}, {"l0": 0})):
        with pytest.raises(RuntimeError, match="l0: kv_cache is not bound"):
            attn(q, kv, kv)
