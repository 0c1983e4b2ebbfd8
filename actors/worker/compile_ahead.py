"""Start-up's Triton kernel variants compiled on a thread pool before the warm-ups launch them.

A cold start compiles every kernel variant the warm-ups launch, one after the other, each when a launch first
needs it: 59 variants in 41.9 s of a 68.2 s start of Qwen3-0.6B on an H100 (RESULTS.md), while the GPU host's
other cores idle. Triton compiles well on threads: on a 2-core machine, 21 paged-attention variants took 41.9 s
one after the other and 20.8 s on two threads (its MLIR passes and ptxas run outside the GIL). On an H100 host
of 16 CPUs a cold start of Qwen3-0.6B took 42.3 s this way, 78.3 s one variant after the other.

So a warm-up phase first runs once dry (`compile_ahead(fn, device, threads)`): `fn` runs as it will for real, but each
Triton launch only names its variant. JITFunction.run takes warmup=True under Triton's AsyncCompileMode, which
hands a variant missing from the cache to the pool and launches nothing. When `fn` returns, the pool's kernels
join Triton's in-memory cache, and the real pass that follows finds every variant it launches already built.
A variant already on disk (a warm cache) is loaded on the pool too.

Why a dry pass is safe to run: no Triton kernel launches in it at all, so none reads an output another one
did not write (a pass that still launched the cached variants could feed one indices nobody wrote). The torch
ops between the kernels run on whatever the skipped kernels' outputs held: GEMMs, elementwise ops, topk over
activations, whose values nobody reads. The indices torch does read come from the host or from static
buffers: the profile run's zero ids and positions, and the input buffers of a dummy step (no rows), which no
kernel writes in a dry pass and which hold ids and positions in range (zeros at allocation, a real step's
afterwards). Anything the dry pass raises is logged and left to the real pass, which compiles what is
missing one variant at a time, as without it.

A pass whose variants are all on disk already is skipped. On a warm cache a dry pass still runs every
bucket's eager forward only to find each variant cached: 1.6-2.1 s of a 10-12 s warm start of Qwen3-0.6B on
an H100. So a pass that ran to its end leaves a manifest in Triton's cache dir: the files its variants were
built into (or loaded from), under a fingerprint of what decides which variants the pass launches (the pass
and its shapes, the engine's config, the model's, kvray's source, the Triton and torch versions, the GPU,
the TRITON_/KVRAY_ environment). The next start with the same fingerprint finds every file there and skips
the pass, where every rank of the engine found its own files (a dry pass runs the model's collectives, so
the ranks skip it together or run it together); its real pass then loads the variants from disk one after
the other, as without compiling ahead (0.5 s for the 59 variants of that start). A fingerprint that missed
something costs only time: a variant the skipped pass would have handed to the pool compiles when the real
pass launches it.

KVRAY_COMPILE_THREADS sets the pool's size (default: this process's CPUs shared by the engine's ranks,
at most 32); 0 turns compiling ahead off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

logger = logging.getLogger(__name__)

THREADS_ENV = "KVRAY_COMPILE_THREADS"
MAX_THREADS = 32


MANIFEST_DIR = "kvray-compile-ahead"  # inside Triton's cache dir


@dataclass(frozen=True)
class CompiledAhead:
    """One dry pass: the variants it handed to the pool (compiled, or loaded from the disk cache) and its wall
    time; `skipped`: its manifest found every variant on disk, so it did not run."""

    variants: int
    wall_s: float
    skipped: bool = False


def compile_threads(ranks_per_engine: int = 1) -> int:
    """The pool's size: KVRAY_COMPILE_THREADS, else this process's CPUs over the engine's ranks (ranks of one
    host compile at the same time), at least 1 and at most MAX_THREADS."""
    env = os.environ.get(THREADS_ENV)
    if env is not None:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{THREADS_ENV}={env!r}: must be an integer (0 turns compiling ahead off)") from None
        if value < 0:
            raise ValueError(f"{THREADS_ENV}={value}: must be >= 0 (0 turns compiling ahead off)")
        return value
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_THREADS, cpus // max(1, ranks_per_engine)))


def _async_compile_mode() -> Any:
    """Triton's AsyncCompileMode, or None where this Triton has none (then nothing compiles ahead)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


class HandedOff:
    """The variants a dry pass handed to the pool, each held in its kernel's in-memory cache as its future
    until the pool has built it: a variant launched again in the pass (every layer of every bucket launches
    the same few) then costs a cache lookup, not Triton's whole miss path (the compile hook, the source hash
    of the cache key). On an H100 that miss path, taken by each of a warm start's ~7,000 dry launches, made
    the dry passes 5.8 s where loading the 58 cached variants takes 0.7 s. Triton 3.9 caches the future
    itself; 3.6 only the built kernel."""

    def __init__(self) -> None:
        self.entries: list[tuple[dict, Any, Any]] = []  # (a kernel's cache, the variant's key, its future)

    def hold(self, cache: dict, key: Any, future: Any) -> None:
        if key not in cache:
            cache[key] = future
            self.entries.append((cache, key, future))

    def drop_unbuilt(self) -> None:
        """After the pool drained: a future still in a cache is a variant that failed to build, which the
        real pass must compile (and report) itself."""
        for cache, key, future in self.entries:
            if cache.get(key) is future:
                del cache[key]
        self.entries.clear()


@contextlib.contextmanager
def launches_skipped(handed_off: HandedOff) -> Iterator[None]:
    """Inside: every Triton launch of this process takes Triton's warmup path: its variant is looked up or
    handed to the pool, and nothing runs on the device."""
    from triton.runtime.jit import JITFunction

    run, do_compile = JITFunction.run, JITFunction._do_compile

    def compile_only(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    def hand_off_once(self: Any, key: Any, signature: Any, device: Any, *rest: Any, **kwargs: Any) -> Any:
        future = do_compile(self, key, signature, device, *rest, **kwargs)
        if future is not None:
            handed_off.hold(self.device_caches[device][0], key, future)
        return future

    JITFunction.run, JITFunction._do_compile = compile_only, hand_off_once
    try:
        yield
    finally:
        JITFunction.run, JITFunction._do_compile = run, do_compile


def built_files(futures: list[Any]) -> list[str] | None:
    """Every file the pool's variants were built into (or loaded from), once the pool drained; None if one
    did not build."""
    files: list[str] = []
    for future in futures:
        kernel = getattr(future, "kernel", None)  # a FutureKernel's built kernel, set as the pool drained
        group = getattr(kernel, "metadata_group", None)
        if not isinstance(group, dict):
            return None
        files += [str(p) for p in group.values()]
    return sorted(files)


@functools.cache
def _source_digest() -> str:
    """kvray's own source (every .py of the packages that hold its kernels and launch them): a changed kernel
    is a changed variant."""
    import actors
    import kvcore

    h = hashlib.sha256()
    for package in (actors, kvcore):
        root = Path(str(package.__file__)).parent
        for path in sorted(root.rglob("*.py")):
            h.update(f"{package.__name__}/{path.relative_to(root)}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def pass_fingerprint(device: torch.device, *parts: object) -> str:
    """What decides the variants a dry pass launches: `parts` (the pass, its shapes, the engine's and the
    model's config, by their repr), kvray's source, the Triton and torch versions, the GPU, and the TRITON_
    and KVRAY_ environment."""
    import triton

    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("TRITON_", "KVRAY_")))
    gpu = (
        (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)) if device.type == "cuda" else ()
    )
    h = hashlib.sha256()
    for part in (*parts, _source_digest(), triton.__version__, torch.__version__, gpu, env):
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()


def _triton_cache_dir() -> Path | None:
    """Triton's on-disk cache, where the manifests live; None under a cache manager of someone else's (its
    files need not be local paths)."""
    try:
        from triton import knobs

        if knobs.cache.manager_class is not None:
            return None
        return Path(knobs.cache.dir)
    except Exception:  # noqa: BLE001 - a Triton without knobs: no manifests, every pass runs
        return None


@dataclass(frozen=True)
class Manifest:
    """The files a dry pass's variants live in, under the pass's fingerprint."""

    path: Path

    @classmethod
    def at(cls, fingerprint: str | None) -> Manifest | None:
        root = _triton_cache_dir() if fingerprint else None
        return None if root is None else cls(root / MANIFEST_DIR / f"{fingerprint}.json")

    def all_on_disk(self) -> bool:
        try:
            files = json.loads(self.path.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return isinstance(files, list) and all(isinstance(f, str) and os.path.isfile(f) for f in files)

    def write(self, files: list[str]) -> None:
        """Atomically (a concurrent start of another rank reads either the old file or the new one)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"files": files}))
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only cache: the next start runs its dry passes again
            logger.warning("compile-ahead manifest %s not written: %s", self.path, e)


def compile_ahead(
    fn: Callable[[], object],
    device: torch.device,
    threads: int,
    fingerprint: str | None = None,
    agree: Callable[[bool], bool] = lambda all_on_disk: all_on_disk,
) -> CompiledAhead | None:
    """Run `fn` dry (see the module docstring) with `threads` compiling the variants it launches; None where
    nothing compiles ahead: not a GPU, no threads, or a Triton without AsyncCompileMode. With a `fingerprint`
    (pass_fingerprint) the pass is skipped when its manifest finds every variant on disk, and a pass that
    runs to its end writes one. `agree` turns this rank's finding into the engine's: a dry pass runs the
    model's collectives, so every rank must skip it or none (each rank calls it, whatever it found)."""
    mode_cls = _async_compile_mode() if device.type == "cuda" and threads > 0 else None
    if mode_cls is None:
        return None
    t0 = time.perf_counter()
    manifest = Manifest.at(fingerprint)
    if agree(manifest is not None and manifest.all_on_disk()):
        logger.info("every Triton kernel variant of this pass is on disk (%s): not run dry", fingerprint)
        return CompiledAhead(0, round(time.perf_counter() - t0, 3), skipped=True)
    finished = False
    handed_off = HandedOff()
    with ThreadPoolExecutor(threads, thread_name_prefix="triton-compile") as pool:
        # A failed compile is dropped, not raised: the real pass compiles it again and reports it there.
        with mode_cls(pool, ignore_errors=True) as mode:
            with launches_skipped(handed_off), torch.inference_mode():
                try:
                    fn()
                    finished = True
                except Exception as e:  # noqa: BLE001 - the real pass runs next and raises what matters
                    logger.warning(
                        "compiling ahead stopped early (%s: %s); the rest compiles when launched",
                        type(e).__name__,
                        e,
                        exc_info=True,
                    )
            futures = list(mode.future_kernels.values())
        # Leaving the mode waited for every compile and put the kernels in Triton's cache.
        variants = len(futures)
        files = built_files(futures) if finished and manifest is not None else None
        handed_off.drop_unbuilt()
    if files is not None and manifest is not None:
        manifest.write(files)
    done = CompiledAhead(variants, round(time.perf_counter() - t0, 3))
    logger.info("compiled %d Triton kernel variants ahead on %d threads in %.1f s", done.variants, threads, done.wall_s)
    return done
