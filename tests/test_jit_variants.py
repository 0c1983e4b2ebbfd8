"""How many kernels a GPU compiles, counted here with Triton's own specialisation rules (tests/jit_variants.py):
each variant is ~0.5-1 s of a cold start, or a stall mid-run when a step's first arrives late."""

import torch
from jit_variants import counting

from actors.sample.inputs import SamplingInputs
from actors.sample.kernel import launch_sample
from actors.sample.logprobs_kernel import topk_logprobs
from actors.sample.sampler import Sampler
from actors.worker.warmup import run_sampler_variants

CPU = torch.device("cpu")


def rows(n: int, vocab: int = 48) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(n)
    return (
        torch.randn(n, vocab, generator=g),
        torch.rand(n, generator=g) + 0.3,
        torch.zeros(n, dtype=torch.int32),
        torch.ones(n),
        torch.randint(0, 2**40, (n,), generator=g),
        torch.randint(0, 500, (n,), generator=g),
    )


def test_the_sampler_warm_up_compiles_one_sample_kernel_per_mode_whatever_its_row_counts():
    """Greedy, random and filtered rows at 1, 8 and 16 rows (one of each integer class Triton would
    specialise a row count on): three variants of the sample kernel, where a specialised row count made
    nine, each ~0.6-0.9 s of the H200's cold start (the start-up log of 608e48f)."""
    inputs = SamplingInputs(32, CPU, pin_memory=False)
    with counting() as variants, torch.inference_mode():
        run_sampler_variants(Sampler(use_triton=True), 64, torch.bfloat16, CPU, 32, inputs.dummy)
    assert variants.of("_sample_kernel") == 3, sorted(variants.keys)


def test_a_new_ban_list_width_or_row_count_compiles_nothing_new():
    """A step whose ban lists (min_tokens' EOS, bad words) are 1, 2 or 16 wide, at 3, 16 or 17 rows, runs
    the variant the first such step compiled, rather than compiling mid-run."""
    with counting() as variants:
        for n, width in ((3, 1), (16, 2), (17, 16)):
            logits, temp, top_k, top_p, seeds, pos = rows(n)
            ban = torch.full((n, width), 3, dtype=torch.int32)
            launch_sample(logits, temp, top_k, top_p, seeds, pos, ban_ids=ban, need_filter=False)
    assert variants.of("_sample_kernel") == 1, sorted(variants.keys)


def test_logprobs_of_any_k_a_request_may_ask_run_the_warm_ups_kernels():
    """The warm-up asks k = 1; a request may ask any k up to MAX_LOGPROBS (vLLM's 20), prompt logprobs
    too. Both logprobs kernels compile once for all of them, where a lane width per k class compiled
    the combine kernel anew (up to five times) in the middle of a run."""
    logits = torch.randn(5, 300)
    tokens = torch.randint(0, 300, (5,))
    with counting() as variants:
        for k in (1, 0, 2, 5, 20):
            topk_logprobs(logits, tokens, k, block=64)
    assert variants.of("_chunk_kernel") == 1 and variants.of("_combine_kernel") == 1, sorted(variants.keys)


def test_decode_steps_of_any_batch_size_run_the_first_ones_kernels(tmp_path):
    """A model's layer kernels (RMSNorm, q/k norm + rotary into the cache, attention, SiLU) through a paged
    KV cache: after the first decode step, steps of 2, 16 and 17 rows (each of Triton's integer classes)
    compile nothing new. Each size-specialised kernel would add compiles to every CUDA-graph bucket's
    warm-up at start-up. (On the CPU the linear layers run torch's ops; the GPU's small-M GEMM does
    specialise on its row count.)"""
    import test_model_forward as forward

    from actors.models.loader import load_model

    forward.make_hf_model("qwen3-hybrid", str(tmp_path), forward.TRITON_LAYERS["qwen3-hybrid"])
    model, _ = load_model(str(tmp_path), dtype="float32", attention_backend="triton")
    driver = forward.PagedDriver(model)
    with counting() as variants:
        driver.step([(i, [5, 6]) for i in range(17)])
        driver.step([(0, [9])])
        first = set(variants.keys)
        for batch in (2, 16, 17):
            driver.step([(i, [9]) for i in range(batch)])
        assert variants.keys == first, sorted(variants.keys - first)
    assert {name for name, _ in first} >= {"paged_attention_kernel", "_rms_norm_kernel", "_qk_norm_rope_kernel"}
