"""Which part of the model this process builds: its pipeline stage's decoder layers, and whether it holds
the embedding (first stage) or the final norm and LM head (last stage).

The loader sets the stage while it builds the model (`building_stage`), so every family's constructor
keeps its signature; a model built outside that context is whole. Layers outside the stage are
`MissingLayer` placeholders, so the kept ones keep their HF names (`model.layers.{i}`) and every rank
reads only its own tensors from the checkpoint.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PipelineStage:
    start: int  # first decoder layer of the stage
    end: int  # one past its last
    is_first: bool
    is_last: bool

    @classmethod
    def whole(cls, num_layers: int) -> "PipelineStage":
        return cls(0, num_layers, True, True)

    def owns_layer(self, index: int) -> bool:
        return self.start <= index < self.end

    def owns_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this stage: a decoder layer's by its index, the
        embedding to the first stage (and to the last when it is tied to the LM head), norm and head
        to the last."""
        m = _LAYER.match(name)
        if m is not None:
            return self.owns_layer(int(m.group(1)))
        if name.startswith("model.embed_tokens."):
            return self.is_first
        return self.is_last


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_BUILDING: PipelineStage | None = None


@contextlib.contextmanager
def building_stage(stage: PipelineStage | None) -> Iterator[None]:
    """Models built inside build only `stage` (None: the whole model)."""
    global _BUILDING
    previous, _BUILDING = _BUILDING, stage
    try:
        yield
    finally:
        _BUILDING = previous


def current_stage(num_layers: int) -> PipelineStage:
    """The stage being built, checked against the model's layer count; the whole model outside a stage."""
    stage = _BUILDING
    if stage is None:
        return PipelineStage.whole(num_layers)
    if not 0 <= stage.start < stage.end <= num_layers:
        raise ValueError(
            f"pipeline stage layers [{stage.start}, {stage.end}) do not fit the model's {num_layers} layers"
        )
    return stage


class MissingLayer(nn.Module):
    """A decoder layer another stage owns: no parameters, never run."""

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("a decoder layer of another pipeline stage was run")


@dataclass
class StageActivations:
    """What one stage hands the next: the hidden state and, in the pre-norm layout, the residual
    (Gemma's sandwich norms carry none). [tokens, hidden_size] each."""

    hidden: torch.Tensor
    residual: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden] if self.residual is None else [self.hidden, self.residual]

    def narrow(self, num_tokens: int) -> "StageActivations":
        return StageActivations(self.hidden[:num_tokens], None if self.residual is None else self.residual[:num_tokens])
