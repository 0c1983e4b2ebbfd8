"""The safetensors files of one HF model directory: which file holds which tensor, opened lazily.

Only safetensors are read (never pickle). `get_slice` returns a lazy slice, so each tensor-parallel
rank reads just the rows/columns of its own shard from disk. Every failure names the file or tensor.
"""

from __future__ import annotations

import os
from typing import Any

from safetensors import SafetensorError, safe_open

from actors.config.hf_json import ModelConfigError, read_json_object, short

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names of the tensors a float model can load (converted to its dtype on copy)
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


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


class CheckpointDtypeError(CheckpointError):
    pass


class Checkpoint:
    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._handles: dict[str, Any] = {}
        self.weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index_path = os.path.join(self.model_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            weight_map: dict[str, str] = self._read_index(index_path)
            for file in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(self.model_dir, file)):
                    raise CheckpointError(f"{index_path} names shard {file!r}, which is missing from {self.model_dir}")
            return weight_map
        files = sorted(f for f in os.listdir(self.model_dir) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(
                f"{self.model_dir}: no *.safetensors weights found "
                "(only safetensors are loaded; pickle .bin/.pt files are refused)"
            )
        weight_map = {}
        for file in files:
            for name in self._open(file).keys():
                weight_map[name] = file
        return weight_map

    def _read_index(self, index_path: str) -> dict[str, str]:
        """The index's weight_map: tensor name -> a .safetensors file inside the model directory.

        A shard path that leaves the directory (absolute, or through '..') is refused: a model is
        data, and its index must not make a worker read any other file on the node.
        """
        try:
            weight_map = read_json_object(index_path).get("weight_map")
        except ModelConfigError as e:
            raise CorruptCheckpointError(f"not a valid safetensors index: {e}") from None
        if not isinstance(weight_map, dict):
            raise CorruptCheckpointError(
                f"{index_path}: weight_map={short(weight_map)} must be an object mapping tensor names to shard files"
            )
        root = os.path.normpath(self.model_dir)
        for name, file in weight_map.items():
            if not isinstance(file, str) or not file.endswith(".safetensors"):
                raise CorruptCheckpointError(
                    f"{index_path}: weight_map[{short(name)}]={short(file)} must be the name of a .safetensors file"
                )
            path = os.path.normpath(os.path.join(root, file))
            if os.path.isabs(file) or os.path.commonpath([root, path]) != root:
                raise CorruptCheckpointError(
                    f"{index_path}: weight_map[{short(name)}]={short(file)} points "
                    f"outside the model directory {root}; shards must lie inside it"
                )
        return dict(weight_map)

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
        """A lazy slice of tensor `name` (supports get_shape() and [a:b, c:d] indexing).

        Only floating-point tensors load: an integer or fp8 tensor is a quantized checkpoint that
        would be cast to garbage under the float dtype the config asks for.
        """
        file = self.file_of(name)
        path = os.path.join(self.model_dir, file)
        try:
            sl = self._open(file).get_slice(name)
            dtype = sl.get_dtype()
        except SafetensorError as e:
            raise CorruptCheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from e
        if dtype not in FLOAT_DTYPES:
            raise CheckpointDtypeError(
                f"tensor {name!r} in {path}: dtype {dtype} does not match the model's "
                f"floating-point dtype (supported checkpoint dtypes: {sorted(FLOAT_DTYPES)}; "
                "quantized checkpoints are not)"
            )
        return sl

    def close(self) -> None:
        self._handles.clear()
