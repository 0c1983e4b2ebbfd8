"""Reading one rank's shard out of a full checkpoint tensor.

Checkpoint tensors arrive either as safetensors slices (`safe_open(...).get_slice(name)`, which read
only the bytes asked for) or as plain tensors (tests, tied weights). Both are narrowed here, so every
parallel layer's weight_loader reads just its own rows or columns from disk.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# (param, the full checkpoint tensor or a lazy slice of it, the shard id of a merged parameter or None)
WeightLoader = Callable[[torch.Tensor, Any, Any], None]


class ShardShapeError(ValueError):
    """The full checkpoint tensor does not have the shape this layer expects.

    Raised by weight loaders; the model's load_weights adds the tensor name and file.
    """

    def __init__(self, expected: tuple[int, ...], got: tuple[int, ...], what: str = "") -> None:
        self.expected, self.got = tuple(expected), tuple(got)
        where = f" ({what})" if what else ""
        super().__init__(f"expected shape {self.expected}, got {self.got}{where}")


def full_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of the whole checkpoint tensor, without reading its data."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def check_full_shape(loaded: Any, expected: tuple[int, ...], what: str = "") -> None:
    got = full_shape(loaded)
    if got != tuple(expected):
        raise ShardShapeError(tuple(expected), got, what)


def narrow(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows/columns [start, start+length) along `dim` (0 or 1) as a tensor; reads only that part."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index: tuple[slice, ...] = (slice(None),) * dim + (slice(start, start + length),)
    return loaded[index]


def read_all(loaded: Any) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[:]


def copy_into(param: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a CPU shard into a parameter on any device, converting dtype; shapes must agree."""
    if tuple(param.shape) != tuple(src.shape):
        raise ShardShapeError(tuple(param.shape), tuple(src.shape), "shard")
    with torch.no_grad():
        param.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
    """Replicated parameters (norms, q/k norms): the whole tensor on every rank."""
    if shard_id is not None:
        raise ValueError(f"replicated parameter takes no shard id, got {shard_id!r}")
    check_full_shape(loaded, tuple(param.shape))
    copy_into(param, read_all(loaded))


def new_param(shape: tuple[int, ...], dtype: torch.dtype, loader: WeightLoader) -> torch.nn.Parameter:
    """An uninitialised inference parameter (on the ambient default device) with its weight_loader."""
    p = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    # The loader rides on the parameter, as in vLLM; torch.nn.Parameter declares no such attribute, so
    # it is set and read through these two functions only.
    setattr(p, "weight_loader", loader)  # noqa: B010 - mypy refuses an attribute Parameter does not declare
    return p


def load_weight(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
    """Run the weight_loader new_param gave `param`."""
    loader: WeightLoader = getattr(param, "weight_loader")  # noqa: B009 - as above, for reading
    loader(param, loaded, shard_id)
