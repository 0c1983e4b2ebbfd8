"""The named benchmark suites of benchmarks/suites.yaml, read into typed records.

A suite is a list of steps; a step runs one benchmark module (`python -m MODULE ARGS`) under a time limit
and declares the metrics it records (fnmatch patterns over record()'s metric names) or, for a smoke, the
text its output must hold. A GPU suite's steps fit one device call (their limits sum to at most
DEVICE_CALL_S per part); a part is a slice of a suite run in its own call (vs-vllm: kvray's side, then vLLM's,
then the ratios). Bad data fails with the suite, the step and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

SUITES_FILE = Path(__file__).resolve().parent / "suites.yaml"
DEVICE_CALL_S = 600  # one device call's limit: a GPU suite's part must fit it
PLACEHOLDERS = ("{models}", "{out}", "{tmp}")
STEP_FIELDS = {"name", "module", "args", "limit_s", "metrics", "expect", "ray", "part", "python", "env"}
SUITE_FIELDS = {"description", "gpu", "gpus", "mirror", "steps"}


@dataclass(frozen=True)
class Step:
    name: str
    module: str  # run as `python -m module`
    args: tuple[str, ...] = ()  # may hold {models}, {out}, {tmp}: filled in by the runner
    limit_s: int = 120
    metrics: tuple[str, ...] = ()  # fnmatch patterns of the metrics the step records
    expect: tuple[str, ...] = ()  # text a smoke's output must hold
    ray: bool = False  # starts engines: the smoke test gives it a shared local Ray
    part: str = "main"
    python: str = "python"  # "python": this interpreter; "vllm": $VLLM_PY (../shared/gpu/vllm/install.sh)
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    gpu: bool
    steps: tuple[Step, ...]
    gpus: int = 1
    mirror: str | None = None  # KVRAY_RESULTS_MIRROR for the run: a folder the parts share on a warm machine

    @property
    def parts(self) -> list[str]:
        seen: list[str] = []
        for s in self.steps:
            if s.part not in seen:
                seen.append(s.part)
        return seen

    def limit_s(self, part: str | None = None) -> int:
        return sum(s.limit_s for s in self.steps if part is None or s.part == part)


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise ValueError(f"{where}: must be a list of strings")
    return tuple(str(v) for v in value)


def _step(raw: object, where: str) -> Step:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a step must be a mapping")
    unknown = set(raw) - STEP_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)} (known: {sorted(STEP_FIELDS)})")
    for key in ("name", "module"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise ValueError(f"{where}: {key!r} must be a non-empty string")
    where = f"{where} ({raw['name']})"
    limit = raw.get("limit_s", 120)
    if not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"{where}: limit_s must be a positive integer of seconds")
    python = raw.get("python", "python")
    if python not in ("python", "vllm"):
        raise ValueError(f"{where}: python must be 'python' or 'vllm', not {python!r}")
    env = raw.get("env", {})
    if not isinstance(env, dict):
        raise ValueError(f"{where}: env must be a mapping of variable to value")
    return Step(
        name=raw["name"],
        module=raw["module"],
        args=_strings(raw.get("args", []), f"{where}: args"),
        limit_s=limit,
        metrics=_strings(raw.get("metrics", []), f"{where}: metrics"),
        expect=_strings(raw.get("expect", []), f"{where}: expect"),
        ray=bool(raw.get("ray", False)),
        part=str(raw.get("part", "main")),
        python=python,
        env={str(k): str(v) for k, v in env.items()},
    )


def _suite(name: str, raw: object) -> Suite:
    where = f"suites.yaml: suite {name!r}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a mapping")
    unknown = set(raw) - SUITE_FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)} (known: {sorted(SUITE_FIELDS)})")
    if not isinstance(raw.get("gpu"), bool):
        raise ValueError(f"{where}: 'gpu' must be true or false")
    steps_raw = raw.get("steps")
    if not isinstance(steps_raw, list) or not steps_raw:
        raise ValueError(f"{where}: 'steps' must be a non-empty list")
    steps = tuple(_step(s, f"{where}, step {i}") for i, s in enumerate(steps_raw))
    names = [s.name for s in steps]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{where}: step names must be unique; repeated: {dup}")
    suite = Suite(
        name=name,
        description=str(raw.get("description", "")),
        gpu=raw["gpu"],
        steps=steps,
        gpus=int(raw.get("gpus", 1 if raw["gpu"] else 0)),
        mirror=raw.get("mirror"),
    )
    if suite.gpu:
        for part in suite.parts:
            if suite.limit_s(part) > DEVICE_CALL_S:
                raise ValueError(
                    f"{where}: part {part!r}'s limits sum to {suite.limit_s(part)} s, over one device call's "
                    f"{DEVICE_CALL_S} s: split it into parts"
                )
    return suite


def load_suites(path: Path = SUITES_FILE) -> dict[str, Suite]:
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("suites"), dict):
        raise ValueError(f"{path}: must hold a mapping 'suites: {{name: suite}}'")
    return {name: _suite(name, s) for name, s in raw["suites"].items()}
