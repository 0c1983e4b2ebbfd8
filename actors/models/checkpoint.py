"""The safetensors files of one HF model directory: which file holds which tensor, opened lazily.

Only safetensors are read (never pickle). `get_slice` returns a lazy slice, so each tensor-parallel
rank reads just the rows/columns of its own shard from disk. Every failure names the file or tensor.
"""
from __future__ import annotations

import json
import os
from typing import Any

from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or tensor at fault."""


class MissingTensorError(CheckpointError):
    pass


class TensorShapeError(CheckpointError):
    pass


class CorruptCheckpointError(CheckpointError):
    pass


class UnexpectedTensorError(CheckpointError):
    pass


class Checkpoint:
    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._handles: dict[str, Any] = {}
        self.weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index_path = os.path.join(self.model_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CorruptCheckpointError(f"{index_path}: not a valid safetensors index ({e})") from e
            for file in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(self.model_dir, file)):
                    raise CheckpointError(f"{index_path} names shard {file!r}, which is missing from {self.model_dir}")
            return dict(weight_map)
        files = sorted(f for f in os.listdir(self.model_dir) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{self.model_dir}: no *.safetensors weights found "
                                  "(only safetensors are loaded; pickle .bin/.pt files are refused)")
        weight_map: dict[str, str] = {}
        for file in files:
            for name in self._open(file).keys():
                weight_map[name] = file
        return weight_map

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            path = os.path.join(self.model_dir, file)
            try:
                self._handles[file] = safe_open(path, framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise CorruptCheckpointError(f"{path}: truncated or corrupt safetensors file ({e})") from e
        return self._handles[file]

    def file_of(self, name: str) -> str:
        if name not in self.weight_map:
            raise MissingTensorError(f"{self.model_dir}: checkpoint has no tensor {name!r}")
        return self.weight_map[name]

    def get_slice(self, name: str) -> Any:
        """A lazy slice of tensor `name` (supports get_shape() and [a:b, c:d] indexing)."""
        file = self.file_of(name)
        try:
            return self._open(file).get_slice(name)
        except SafetensorError as e:
            path = os.path.join(self.model_dir, file)
            raise CorruptCheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from e

    def close(self) -> None:
        self._handles.clear()
