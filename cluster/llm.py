"""The offline API, shaped like vLLM's: LLM(model=..., ...).generate(prompts, sampling_params).

Prompts are tokenized here, on the client, and outputs decoded here; the engines see token ids only.
Outputs come back in input order. A bad prompt gets an output whose finish_reason is "error" (with the
message in `.error`) while the others proceed; a replica that fails for good raises EngineFailure.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from actors.driver import RequestSpec, RequestTiming
from cluster.config import ConfigError, EngineConfig, apply_overrides, load_config, validate_for_model
from cluster.engines import EngineFailure, EngineGroup, Finished
from kvcore.request import SamplingParams, check_text, check_token_ids

logger = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestTiming | None = None


class PromptError(ValueError):
    """A prompt that cannot become a request; the message names the prompt and the rule."""


def load_client_model(config: EngineConfig) -> tuple[Any, dict[str, Any] | None]:
    """The tokenizer and config.json as this client sees them (None where the model is not local)."""
    from actors.loader import read_hf_config, resolve_model_dir
    from cluster.tokenizer import load_tokenizer_if_present

    try:
        model_dir = resolve_model_dir(config.model.model)
    except FileNotFoundError:
        # The model may live only on the cluster's nodes: token-id prompts still work.
        logger.warning("model %r is not on this machine: text prompts need a tokenizer", config.model.model)
        return None, None
    return load_tokenizer_if_present(model_dir), read_hf_config(model_dir)


def check_client_model(config: EngineConfig, hf_config: dict[str, Any]) -> None:
    """Fail on this machine, before any actor starts, when the config cannot run this model."""
    from actors.models.registry import resolve_architecture

    validate_for_model(config, hf_config)
    resolve_architecture(hf_config)  # an unsupported architecture names itself and the supported ones


class LLM:
    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 worker_cls: str = "actors.worker.Worker", **kwargs: Any) -> None:
        if config is None:
            config = EngineConfig()
        if model is not None:
            kwargs["model"] = model
        self.config = apply_overrides(config, kwargs) if kwargs else config
        self.tokenizer, hf_config = load_client_model(self.config)
        if hf_config is not None:
            check_client_model(self.config, hf_config)  # fail before any actor starts
        self._ids = itertools.count()
        self.engines: EngineGroup | None = EngineGroup(self.config, worker_cls=worker_cls)

    @classmethod
    def from_config(cls, path: str, **overrides: Any) -> "LLM":
        return cls(config=load_config(path, overrides))

    # ---- prompts ----------------------------------------------------------------------------
    def encode(self, index: int, prompt: Any) -> tuple[str | None, list[int]]:
        """-> (text or None, token ids) for one prompt: a str, or {"prompt"} / {"prompt_token_ids"}."""
        if isinstance(prompt, dict):
            keys = set(prompt)
            if keys == {"prompt_token_ids"}:
                ids = prompt["prompt_token_ids"]
                err = check_token_ids(f"prompts[{index}].prompt_token_ids", ids)
                if err is not None:
                    raise PromptError(err)
                return None, list(ids)
            if keys == {"prompt"}:
                prompt = prompt["prompt"]
            else:
                raise PromptError(f"prompts[{index}]: a dict prompt holds exactly one of 'prompt' or "
                                  f"'prompt_token_ids', got keys {sorted(keys)}")
        if not isinstance(prompt, str):
            raise PromptError(f"prompts[{index}]={prompt!r}: must be a str or a dict with 'prompt_token_ids'")
        err = check_text(f"prompts[{index}]", prompt)
        if err is not None:
            raise PromptError(err)
        if self.tokenizer is None:
            raise PromptError(f"prompts[{index}]: text prompt, but the model has no tokenizer.json here; "
                              f"pass {{'prompt_token_ids': [...]}} instead")
        return prompt, self.tokenizer.encode(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    # ---- generate ---------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if self.engines is None:
            raise RuntimeError("LLM.generate: this LLM is shut down")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _params_list(sampling_params, len(prompts))
        results: list[RequestOutput | None] = [None] * len(prompts)
        specs, index_of = [], {}
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            rid = str(next(self._ids))
            try:
                text, ids = self.encode(i, prompt)
            except PromptError as e:
                results[i] = _error_result(rid, prompt if isinstance(prompt, str) else None, [], str(e))
                continue
            results[i] = RequestOutput(rid, text, ids, [CompletionOutput(0, "", [], None)], finished=False)
            specs.append(RequestSpec(rid, ids, sp))
            index_of[rid] = i
        for rid, err in self.engines.submit(specs).items():
            res = results[index_of.pop(rid)]
            res.error, res.finished = err, True
            res.outputs[0].finish_reason = "error"
        self._collect(results, index_of, use_tqdm)
        return results  # type: ignore[return-value]

    def _collect(self, results: list[RequestOutput | None], index_of: dict[str, int], use_tqdm: bool) -> None:
        bar = _progress(len(index_of), use_tqdm)
        while index_of:
            for item in self.engines.poll(timeout_s=1.0):
                o = item.output if isinstance(item, Finished) else item
                i = index_of.get(o.request_id)
                if i is None:
                    continue  # an error record already handled at submit
                res = results[i]
                res.outputs[0].token_ids.extend(o.new_token_ids)
                if isinstance(item, Finished):
                    self._complete(res, item)
                    del index_of[o.request_id]
                    if bar is not None:
                        bar.update(1)
            if self.engines.fatal is not None:
                if bar is not None:
                    bar.close()
                raise EngineFailure(self.engines.fatal)
        if bar is not None:
            bar.close()

    def _complete(self, res: RequestOutput, item: Finished) -> None:
        o = item.output
        comp = res.outputs[0]
        comp.finish_reason, comp.stop_reason = o.finish_reason, o.stop_reason
        comp.text = self.decode(comp.token_ids)
        res.finished, res.error, res.metrics = True, o.error, item.timing
        res.num_cached_tokens = o.num_cached_tokens

    # ---- introspection and teardown ---------------------------------------------------------
    def stats(self) -> list[dict[str, Any]]:
        return self.engines.stats() if self.engines is not None else []

    def shutdown(self) -> None:
        if self.engines is not None:
            self.engines.shutdown()
            self.engines = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _params_list(sp: Any, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"sampling_params: got a list of {len(sp)} for {n} prompts; give one, or one per prompt")
    for i, p in enumerate(sp):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}]={p!r}: must be a SamplingParams")
    return sp


def _error_result(rid: str, prompt: str | None, ids: list[int], message: str) -> RequestOutput:
    return RequestOutput(rid, prompt, ids, [CompletionOutput(0, "", [], "error")], True, message)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")


__all__ = ["LLM", "RequestOutput", "CompletionOutput", "PromptError", "ConfigError", "EngineFailure"]
