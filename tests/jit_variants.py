"""How many kernels a GPU would compile for a run of Triton launches, counted on a machine without one.

The CPU tests run kernels under TRITON_INTERPRET=1, which never specialises. On a GPU, Triton's JIT
compiles one variant per distinct specialisation key: each constexpr's value, each integer argument's
class (equal to 1, divisible by 16, or neither) unless the kernel names it in do_not_specialize, each
pointer's alignment. Each variant costs ~0.5-1 s of a cold start. This helper records the launches the
interpreter runs and computes the keys with Triton's own binder for an sm_90 target (no driver needed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature


class Variants:
    """The distinct (kernel, specialisation key) pairs of the launches recorded so far."""

    def __init__(self) -> None:
        self.keys: set[tuple[str, str]] = set()
        self._binders: dict[Any, Any] = {}
        self._backend = make_backend(GPUTarget("cuda", 90, 32))

    def add(self, interpreted: InterpretedFunction, args: tuple, kwargs: dict) -> None:
        binder = self._binders.get(interpreted.fn)
        if binder is None:
            jit = JITFunction(interpreted.fn, **{k: v for k, v in interpreted.kwargs.items() if v is not None})
            binder = self._binders[interpreted.fn] = create_function_from_signature(
                jit.signature, jit.params, self._backend
            )
        _, specialization, options = binder(*args, **kwargs)
        self.keys.add((interpreted.fn.__name__, str((tuple(specialization), str(options)))))

    def of(self, kernel_name: str) -> int:
        return sum(1 for name, _ in self.keys if name == kernel_name)


@contextlib.contextmanager
def counting() -> Iterator[Variants]:
    """Inside: every interpreted launch is also keyed as a GPU's JIT would key it."""
    variants = Variants()
    run = InterpretedFunction.run

    def keyed_run(self: InterpretedFunction, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        variants.add(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = keyed_run  # type: ignore[method-assign]
    try:
        yield variants
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]
