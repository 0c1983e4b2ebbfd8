"""YAML for configs and --set values: safe tags only, bounded in size, `1e3` read as a number.

PyYAML's safe_load shares an anchored node among all its aliases, so a 600-byte "billion laughs"
document loads quickly, and then anything that walks it (to_dict, a repr in an error message) expands
it to gigabytes. Here the composed node graph is measured first, counting every alias as the copy it
becomes, and a document past MAX_NODES is refused before a Python object is built.

YAML 1.1 (PyYAML) reads `1e3` as the string "1e3" (its floats need a dot: `1.0e+3`); a user writing
`step_timeout_s: 1e3` means a number, so floats are resolved as YAML 1.2 core does.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # a config is a few KB
MAX_NODES = 100_000  # scalars + collections after expanding every alias
MAX_DEPTH = 64


class YamlLimitError(ValueError):
    """The document breaks a size rule; the message names the rule, never the document's content."""


_FLOAT = re.compile(
    r"""^(?:
    [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
  | [-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
  | [-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
  | [-+]?\.(?:inf|Inf|INF)
  | \.(?:nan|NaN|NAN))$""",
    re.X,
)


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e3`, `-2E-5`)."""


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:float"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _expanded_size(node: yaml.Node, limit: int) -> int:
    """Nodes in the document with every alias expanded; stops counting once past `limit`."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()

    def size(n: yaml.Node, depth: int) -> int:
        key = id(n)
        if key in sizes:
            return sizes[key]
        if key in in_progress:  # a recursive anchor (&a [*a]) expands without end
            raise YamlLimitError("a recursive alias (an anchor used inside itself)")
        if depth > MAX_DEPTH:
            raise YamlLimitError(f"nested deeper than {MAX_DEPTH} levels")
        in_progress.add(key)
        total = 1
        if isinstance(n, yaml.SequenceNode):
            children = n.value
        elif isinstance(n, yaml.MappingNode):
            children = [c for pair in n.value for c in pair]
        else:
            children = []
        for c in children:
            total += size(c, depth + 1)
            if total > limit:
                raise YamlLimitError(f"expands to more than {limit} nodes (aliases counted as copies)")
        in_progress.discard(key)
        sizes[key] = total
        return total

    return size(node, 0)


def load_yaml(text: str, max_nodes: int = MAX_NODES) -> Any:
    """One YAML document -> Python data (None for an empty one); YAMLError or YamlLimitError otherwise."""
    if len(text) > MAX_BYTES:
        raise YamlLimitError(f"{len(text)} characters; a config is at most {MAX_BYTES}")
    loader = ConfigLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise YamlLimitError("nested too deeply") from None
        if node is None:
            return None
        _expanded_size(node, max_nodes)
        try:
            return loader.construct_document(node)
        except ValueError as e:  # an int with thousands of digits
            raise YamlLimitError(f"a value cannot be read ({str(e)[:100]})") from None
    finally:
        loader.dispose()
