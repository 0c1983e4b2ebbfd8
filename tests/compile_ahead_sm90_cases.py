"""Start-up's dry passes on Triton's own JIT (actors/worker/compile_ahead.py), run by tests/test_compile_ahead.py in
a process of their own without TRITON_INTERPRET (under it @triton.jit builds interpreted functions, which never
compile): each variant a pass launches compiles on the pool for an sm_90 target, nothing launches, and the real
pass then finds every variant built. A Triton driver that knows its target and refuses to launch stands in for
the GPU.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch
import triton
import triton.compiler
import triton.language as tl
from triton.runtime.jit import JITFunction

from actors.worker import compile_ahead as ca


@triton.jit
def _never_interpreted() -> None:
    pass


assert isinstance(_never_interpreted, JITFunction), "run without TRITON_INTERPRET (tests/test_compile_ahead.py)"


def _scale(x_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x * factor, mask=offs < n)


def _bad(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.load(x_ptr + tl.arange(0, BLOCK)) + UNDEFINED)  # noqa: F821


scale_kernel = JITFunction(_scale)
bad_kernel = JITFunction(_bad)


class Sm90Driver:
    """What JITFunction.run asks a driver before it launches; a launch itself raises."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def __getattr__(self, name):  # launcher_cls, utils (load_binary): a launch
        raise AssertionError(f"the dry pass touched the driver's {name!r}: something launched")


@pytest.fixture
def sm90(monkeypatch, tmp_path):
    """An sm_90 driver, an empty Triton cache, and the interpreter off (the CPU suite may turn it on)."""
    from triton.runtime.driver import driver

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    saved = driver._active  # reset_active() would build the real driver, which needs a GPU
    driver.set_active(Sm90Driver())
    for kernel in (scale_kernel, bad_kernel):
        kernel.device_caches.clear()
    try:
        yield
    finally:
        driver._active = saved
        for kernel in (scale_kernel, bad_kernel):
            kernel.device_caches.clear()


def launch_all(x: torch.Tensor) -> None:
    """Three variants (BLOCK 64, 128, 256), each launched twice, as a warm-up's repeated shapes do."""
    for block in (64, 128, 256, 64, 128, 256):
        scale_kernel[(1,)](x, x.numel(), 2.0, BLOCK=block)


def cached_variants() -> list:
    return [k for cache in scale_kernel.device_caches.values() for k in cache[0].values()]


def test_a_dry_pass_compiles_each_variant_once_on_the_pool_and_launches_nothing(sm90, caplog, monkeypatch):
    x = torch.ones(100)
    compiled_on = []
    compile_fn = triton.compiler.compile

    def compile_and_note(*args, **kwargs):
        compiled_on.append(threading.current_thread().name)
        return compile_fn(*args, **kwargs)

    monkeypatch.setattr(triton.compiler, "compile", compile_and_note)  # what JITFunction's binder picks up
    with caplog.at_level(logging.WARNING, logger=ca.__name__):
        done = ca.compile_ahead(lambda: launch_all(x), torch.device("cuda"), threads=3)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text  # nothing stopped it
    assert done is not None and done.variants == 3 and done.wall_s > 0
    assert len(compiled_on) == 3 and all(name.startswith("triton-compile") for name in compiled_on), compiled_on
    assert torch.equal(x, torch.ones(100))  # no kernel ran
    kernels = cached_variants()
    assert len(kernels) == 3 and all("cubin" in k.asm for k in kernels)  # built down to sm_90 machine code
    assert len({k.hash for k in kernels}) == 3


def test_a_variant_launched_again_in_the_pass_is_looked_up_not_handed_off_again(sm90, monkeypatch):
    """Triton's miss path (the compile hook, the cache key's source hash) runs once a variant, whatever the
    number of launches: a warm start's dry pass launches each variant thousands of times."""
    from triton import knobs

    misses = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: misses.append(kw["key"]) or False)
    x = torch.ones(100)
    done = ca.compile_ahead(lambda: [launch_all(x) for _ in range(5)], torch.device("cuda"), threads=2)
    assert done is not None and done.variants == 3
    assert len(misses) == 3


def test_the_real_pass_after_it_compiles_nothing(sm90, monkeypatch):
    """What the dry pass built is in Triton's in-memory cache: the real launches' lookups all hit (a miss
    would call the compile hook, and then the refusing driver)."""
    from triton import knobs

    x = torch.ones(100)
    ca.compile_ahead(lambda: launch_all(x), torch.device("cuda"), threads=2)
    misses = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: misses.append(kw["key"]) or False)
    # The real pass's lookups, without the launch the refusing driver cannot do: warmup=True stops there.
    for block in (64, 128, 256):
        assert JITFunction.run(scale_kernel, x, x.numel(), 2.0, BLOCK=block, grid=(1,), warmup=True) is not None
    assert misses == []


def test_a_failing_pass_is_logged_and_what_it_launched_before_still_compiles(sm90, caplog):
    x = torch.ones(100)

    def fails_halfway():
        scale_kernel[(1,)](x, x.numel(), 2.0, BLOCK=64)
        raise RuntimeError("a host check the dry pass tripped")

    with caplog.at_level(logging.WARNING, logger=ca.__name__):
        done = ca.compile_ahead(fails_halfway, torch.device("cuda"), threads=2)
    assert "a host check the dry pass tripped" in caplog.text
    assert done is not None and done.variants == 1 and len(cached_variants()) == 1


def test_a_variant_that_fails_to_compile_is_left_to_the_real_pass(sm90):
    """ignore_errors: the dry pass drops it (the real launch compiles it again and raises there, as without
    compiling ahead), and the variants that compile are kept."""
    x = torch.ones(256)

    def both():
        bad_kernel[(1,)](x, BLOCK=64)
        scale_kernel[(1,)](x, x.numel(), 2.0, BLOCK=64)

    done = ca.compile_ahead(both, torch.device("cuda"), threads=2)
    assert done is not None and done.variants == 2
    assert len(cached_variants()) == 1
    assert not [k for cache in bad_kernel.device_caches.values() for k in cache[0].values()]


def _new_process() -> None:
    """What a later start begins with: Triton's in-memory caches empty, its disk cache as left."""
    for kernel in (scale_kernel, bad_kernel):
        kernel.device_caches.clear()


def test_a_pass_whose_variants_are_all_on_disk_is_skipped_at_the_next_start(sm90, monkeypatch, tmp_path):
    x = torch.ones(100)
    first = ca.compile_ahead(lambda: launch_all(x), torch.device("cuda"), threads=2, fingerprint="fp")
    assert first is not None and first.variants == 3 and not first.skipped
    manifest = tmp_path / "triton-cache" / ca.MANIFEST_DIR / "fp.json"
    files = json.loads(manifest.read_text())["files"]
    assert len(files) >= 3 and all(Path(f).is_file() for f in files)  # each variant's cubin, metadata, IR
    _new_process()
    ran = []
    again = ca.compile_ahead(lambda: ran.append(1), torch.device("cuda"), threads=2, fingerprint="fp")
    assert again is not None and again.skipped and again.variants == 0 and ran == []
    # Another fingerprint (another config, source or GPU) runs its pass.
    other = ca.compile_ahead(lambda: launch_all(x), torch.device("cuda"), threads=2, fingerprint="other")
    assert other is not None and not other.skipped and other.variants == 3


def test_a_variant_gone_from_the_disk_cache_runs_the_pass_again(sm90, tmp_path):
    x = torch.ones(100)
    ca.compile_ahead(lambda: launch_all(x), torch.device("cuda"), threads=2, fingerprint="fp")
    files = json.loads((tmp_path / "triton-cache" / ca.MANIFEST_DIR / "fp.json").read_text())["files"]
    Path(next(f for f in files if f.endswith(".cubin"))).unlink()
    _new_process()
    again = ca.compile_ahead(lambda: launch_all(x), torch.device("cuda"), threads=2, fingerprint="fp")
    assert again is not None and not again.skipped and again.variants == 3


def test_a_pass_that_did_not_finish_or_build_everything_leaves_no_manifest(sm90, tmp_path):
    """Its next start must run it: a skipped pass would leave the rest to compile one at a time."""
    x = torch.ones(256)

    def fails_halfway():
        scale_kernel[(1,)](x, x.numel(), 2.0, BLOCK=64)
        raise RuntimeError("a host check the dry pass tripped")

    def with_a_bad_variant():
        bad_kernel[(1,)](x, BLOCK=64)
        scale_kernel[(1,)](x, x.numel(), 2.0, BLOCK=64)

    ca.compile_ahead(fails_halfway, torch.device("cuda"), threads=2, fingerprint="halfway")
    ca.compile_ahead(with_a_bad_variant, torch.device("cuda"), threads=2, fingerprint="bad")
    manifests = tmp_path / "triton-cache" / ca.MANIFEST_DIR
    assert not (manifests / "halfway.json").exists() and not (manifests / "bad.json").exists()


def test_every_rank_skips_the_pass_or_none_runs_it(sm90):
    """A dry pass runs the model's collectives: a rank that skips while another runs would hang both. Each
    rank hands its finding to `agree` (the engine's all-reduce of it) and follows the answer."""
    x = torch.ones(100)
    findings: list[bool] = []

    def another_rank_lacks_a_file(all_on_disk: bool) -> bool:
        findings.append(all_on_disk)
        return False

    ca.compile_ahead(lambda: launch_all(x), torch.device("cuda"), threads=2, fingerprint="fp")
    _new_process()
    ran = []
    done = ca.compile_ahead(
        lambda: ran.append(1) or launch_all(x),
        torch.device("cuda"),
        threads=2,
        fingerprint="fp",
        agree=another_rank_lacks_a_file,
    )
    assert findings == [True]  # this rank had everything on disk
    assert done is not None and not done.skipped and ran == [1] and done.variants == 3
    # Without a fingerprint the rank still takes part in the agreement, finding nothing on disk.
    ca.compile_ahead(lambda: None, torch.device("cuda"), threads=2, agree=another_rank_lacks_a_file)
    assert findings == [True, False]
