"""Our models against HF transformers (eager attention, float32, CPU), through a real paged KV cache
with the torch attention backend (and with the Triton one, interpreted, for two families).

Each family is a tiny random HF model built with transformers' own config class, given weights large
enough that logits are well separated, saved with save_pretrained and loaded by our loader. Two
sequences run as one batch: a chunked prefill mixed with a whole prompt, then a prefill chunk
mixed with a decode, then decode steps token by token, with padding tokens (slot -1) at the end of
every batch. KV-cache groups follow the layers' windows, each group with its own scrambled block
table; sliding groups drop blocks that fall out of the window to the null block 0, whose memory (like
every unwritten slot) holds NaN, so a read outside the window or past the context would show.
The same comparison runs at TP=2 and TP=4 (KV heads replicated) in spawned gloo processes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from actors import parallel_state
from actors.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from actors.models.loader import load_model

ATOL = RTOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 64
NUM_PAD = 3  # padding tokens appended to every batch (slot -1)
PROMPTS = (30, 17)  # prompt lengths of the two sequences
FIRST_CHUNK = 19  # sequence 0's prefill is split: 19 tokens, then 11 (mixed with a decode)
NUM_DECODE = 4

COMMON = dict(
    vocab_size=301,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

FAMILIES = {
    "llama3-rope": (
        "Llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=False,
        ),
    ),
    "llama-bias-linear-rope": (
        "Llama",
        dict(
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3", dict(head_dim=24)),
    "qwen3-hybrid": (
        "Qwen3",
        dict(
            use_sliding_window=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "mistral-window": ("Mistral", dict(sliding_window=8, head_dim=16)),
    "gemma2": (
        "Gemma2",
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=10.0,
        ),
    ),
    "gemma3": (
        "Gemma3Text",
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),
    "qwen3-moe": (
        "Qwen3Moe",
        dict(
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
}


def _init_large(model: torch.nn.Module, seed: int) -> None:
    """HF's init (std 0.02) gives near-uniform logits and greedy ties; these scales separate them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("model.norm.weight"):
                p.copy_(noise)  # mixed signs: no token merely predicts itself
            elif "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.3 * noise)


# The interpreted Triton runs pay per layer: two layers there, still one of each kind (sliding and
# full attention; Qwen3-MoE's sparse and dense MLP).
TWO_LAYERS = {"num_hidden_layers": 2}
TRITON_LAYERS = {
    "qwen3-hybrid": dict(TWO_LAYERS, layer_types=["sliding_attention", "full_attention"]),
    "gemma3": dict(TWO_LAYERS, layer_types=["sliding_attention", "full_attention"]),
    "gemma2": TWO_LAYERS,
    "llama3-rope": TWO_LAYERS,
    "qwen3-moe": TWO_LAYERS,
}


def make_hf_model(family: str, path: str, layers: dict | None = None) -> torch.nn.Module:
    # transformers is imported here, not at module level, so the spawned TP workers (which import
    # this module) start fast.
    import transformers

    prefix, extra = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **extra, **(layers or {})})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _init_large(model, seed=sum(map(ord, family)))
    model.save_pretrained(path)
    return model


def hf_reference(hf_model: torch.nn.Module) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Per sequence: prompt + HF's greedy continuation, and HF's logits at every position of it
    (one full forward, no HF cache)."""
    gen = torch.Generator().manual_seed(7)
    seqs, logits = [], []
    for length in PROMPTS:
        tokens = torch.randint(0, COMMON["vocab_size"], (length,), generator=gen).tolist()
        with torch.no_grad():
            for _ in range(NUM_DECODE + 1):
                tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
            logits.append(hf_model(torch.tensor([tokens])).logits[0].float())
        seqs.append(tokens)
    return seqs, logits


class PagedDriver:
    """A minimal stand-in for the model runner: block tables, slot mappings and metadata per
    KV-cache group, built by hand."""

    def __init__(self, model: torch.nn.Module, seed: int = 0) -> None:
        self.model = model
        self.layers = model.attention_layers()
        windows = sorted({a.sliding_window for a in self.layers}, key=lambda w: -1 if w is None else w)
        self.windows = windows  # group id -> window
        self.layer_to_group = {a.layer_name: windows.index(a.sliding_window) for a in self.layers}
        for a in self.layers:
            a.kv_cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, a.num_kv_heads, a.head_size), float("nan"))
        gen = torch.Generator().manual_seed(seed)
        # Each group hands out block ids from its own scrambled pool (never 0, the null block).
        self.free = [(torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist() for _ in windows]
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[list[int]]] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one batch; chunks = [(seq id, its new tokens)]. Returns each chunk's logits."""
        ids, pos, starts, seq_lens = [], [], [0], []
        for sid, new in chunks:
            done = self.tokens.setdefault(sid, [])
            ids += new
            pos += range(len(done), len(done) + len(new))
            done += new
            starts.append(starts[-1] + len(new))
            seq_lens.append(len(done))
            self._allocate(sid, len(done), first_pos=len(done) - len(new))
        n = len(ids)
        mds = {gid: self._metadata(gid, chunks, starts, seq_lens, pos, n) for gid in range(len(self.windows))}
        input_ids = torch.tensor(ids + [0] * NUM_PAD)
        positions = torch.tensor(pos + [0] * NUM_PAD)
        with torch.no_grad(), set_forward_context(ForwardContext(mds, self.layer_to_group)):
            hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden[:n])
        return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]

    def _allocate(self, sid: int, num_tokens: int, first_pos: int) -> None:
        rows = self.blocks.setdefault(sid, [[] for _ in self.windows])
        for gid, window in enumerate(self.windows):
            while len(rows[gid]) * BLOCK_SIZE < num_tokens:
                rows[gid].append(self.free[gid].pop())
            if window is not None:
                # Blocks wholly before the first key any query of this step can see go to the null block.
                first_visible = max(0, first_pos - window + 1)
                for j in range(first_visible // BLOCK_SIZE):
                    rows[gid][j] = 0

    def _metadata(self, gid: int, chunks, starts, seq_lens, pos, n) -> AttentionMetadata:
        rows = [self.blocks[sid][gid] for sid, _ in chunks]
        width = max(map(len, rows)) + 1  # one spare column, like a runner's fixed-width table
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for r, row in enumerate(rows):
            table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
        slots = []
        for r in range(len(chunks)):
            for p in pos[starts[r] : starts[r + 1]]:
                slots.append(rows[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        slot_mapping = torch.tensor(slots + [-1] * NUM_PAD, dtype=torch.int64)
        q_lens = [starts[i + 1] - starts[i] for i in range(len(chunks))]
        return AttentionMetadata(
            num_actual_tokens=n,
            num_reqs=len(chunks),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
            slot_mapping=slot_mapping,
        )


def run_schedule(model: torch.nn.Module, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Our logits for every position of each sequence (prompt, then the given continuation fed one
    token per step, as a runner would after sampling)."""
    a, b = seqs
    p0, p1 = PROMPTS
    driver = PagedDriver(model)
    out0, out1 = driver.step([(0, a[:FIRST_CHUNK]), (1, b[:p1])])
    dec1, rest0 = driver.step([(1, b[p1 : p1 + 1]), (0, a[FIRST_CHUNK:p0])])
    got = [[out0, rest0], [out1, dec1]]
    for i in range(NUM_DECODE):
        l1, l0 = driver.step([(1, b[p1 + 1 + i : p1 + 2 + i]), (0, a[p0 + i : p0 + 1 + i])])
        got[0].append(l0)
        got[1].append(l1)
    return [torch.cat(g) for g in got]


def _compare(ours: list[torch.Tensor], ref: list[torch.Tensor], seqs: list[list[int]]) -> None:
    for s, (o, r, tokens) in enumerate(zip(ours, ref, seqs, strict=True)):
        n = o.shape[0]
        assert PROMPTS[s] + NUM_DECODE <= n <= len(tokens), (s, n)
        torch.testing.assert_close(o, r[:n], atol=ATOL, rtol=RTOL, msg=lambda m, s=s: f"sequence {s}: {m}")
        # Greedy: from the end of the prompt on, our argmax is HF's next token.
        last = min(n, len(tokens) - 1)
        assert o[PROMPTS[s] - 1 : last].argmax(-1).tolist() == tokens[PROMPTS[s] : last + 1], (
            f"sequence {s}: greedy tokens differ"
        )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matches_hf_tp1(family: str, tmp_path) -> None:
    hf_model = make_hf_model(family, str(tmp_path))
    seqs, ref = hf_reference(hf_model)
    model, _ = load_model(str(tmp_path), dtype="float32", attention_backend="torch")
    if family == "qwen3-hybrid":
        assert [a.sliding_window for a in model.attention_layers()] == [8, None, 8]
    if family == "mistral-window":
        assert {a.sliding_window for a in model.attention_layers()} == {8}
    assert [a.layer_name for a in model.attention_layers()] == [
        f"model.layers.{i}.self_attn.attn" for i in range(COMMON["num_hidden_layers"])
    ]
    _compare(run_schedule(model, seqs), ref, seqs)


@pytest.mark.parametrize("family", ["qwen3-hybrid", "llama3-rope", "gemma2", "gemma3", "qwen3-moe"])
def test_matches_hf_triton_backend(family: str, tmp_path) -> None:
    """The same schedule through the Triton kernels (interpreted on the CPU in CI), on two layers."""
    hf_model = make_hf_model(family, str(tmp_path), TRITON_LAYERS[family])
    seqs, ref = hf_reference(hf_model)
    model, _ = load_model(str(tmp_path), dtype="float32", attention_backend="triton")
    assert {a.backend for a in model.attention_layers()} == {"triton"}
    windows = [a.sliding_window for a in model.attention_layers()]
    assert windows == ([8, None] if family in ("qwen3-hybrid", "gemma2", "gemma3") else [None, None]), windows
    if family == "qwen3-moe":
        assert type(hf_model.model.layers[0].mlp) is not type(hf_model.model.layers[1].mlp)  # sparse, dense
    _compare(run_schedule(model, seqs), ref, seqs)


def test_profile_run_returns_zeros(tmp_path) -> None:
    make_hf_model("qwen3-hybrid", str(tmp_path))
    model, _ = load_model(str(tmp_path), dtype="float32")
    with torch.no_grad(), set_forward_context(ForwardContext(None, {})):
        hidden = model(torch.arange(10), torch.arange(10))
        assert hidden.shape == (10, COMMON["hidden_size"])
        assert torch.isfinite(hidden).all()
    attn = model.attention_layers()[0]
    with set_forward_context(ForwardContext(None, {})):
        q = torch.randn(5, attn.num_heads * attn.head_size)
        k = torch.randn(5, attn.num_kv_heads * attn.head_size)
        assert torch.equal(attn(q, k, k), torch.zeros_like(q))


def _tp_worker(rank: int, world: int, model_dir: str, seqs, result_dir: str) -> None:
    torch.set_num_threads(1)
    # A file rendezvous: a free port picked first could be taken before rank 0 binds it (a loaded host).
    parallel_state.init_tensor_parallel(rank, world, f"file://{result_dir}/rendezvous", "gloo")
    try:
        model, _ = load_model(model_dir, dtype="float32")
        layer = model.attention_layers()[0]
        shapes = (layer.num_heads, layer.num_kv_heads)
        torch.save({"logits": run_schedule(model, seqs), "heads": shapes}, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy_tensor_parallel()


@pytest.mark.parametrize("family,world", [("llama3-rope", 2), ("qwen2", 2), ("qwen3-hybrid", 4)])
def test_matches_hf_tensor_parallel(family: str, world: int, tmp_path) -> None:
    """Sharded heads, MLP and vocab (301 is not a multiple of the TP size, so padding is exercised);
    at TP=4 with 2 KV heads each KV head is replicated on two ranks. Every rank gets the full logits."""
    model_dir = str(tmp_path / "model")
    hf_model = make_hf_model(family, model_dir)
    seqs, ref = hf_reference(hf_model)
    mp.start_processes(
        _tp_worker,
        args=(world, model_dir, seqs, str(tmp_path)),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["heads"] == (
            COMMON["num_attention_heads"] // world,
            max(1, COMMON["num_key_value_heads"] // world),
        )
        _compare(result["logits"], ref, seqs)
