"""The offline API, shaped like vLLM's: LLM(model=..., ...).generate(prompts, sampling_params).

Prompts are tokenized here, on the client (chat messages rendered with the model's chat template first),
and outputs are made here by the OutputProcessor (detokenization, stop strings, n samples, logprobs); the
engines see token ids only. Outputs come back in input order. A bad prompt gets an output whose
finish_reason is "error" (with the message in `.error`) while the others proceed; a replica that fails
for good raises EngineFailure.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from actors.messages import RequestSpec
from cluster.client.chat import (
    ChatTemplateError,
    as_conversations,
    check_chat_flags,
    render_chat,
    resolve_chat_template,
    special_tokens,
)
from cluster.client.logprobs import engine_computes_logprobs
from cluster.client.output_processor import OutputProcessor, ParentRequest
from cluster.client.sampling_defaults import default_sampling_params
from cluster.client.stream import ProcessedStream
from cluster.config import (
    DEFAULT_WORKER_CLS,
    ConfigError,
    EngineConfig,
    apply_overrides,
    load_config,
    validate_for_model,
)
from cluster.outputs import CompletionOutput, Logprob, RequestOutput, error_output
from cluster.replicas.engine_group import EngineFailure, EngineGroup
from kvcore.request import SamplingParams, check_text, check_token_ids

logger = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt that cannot become a request; the message names the prompt and the rule."""


def check_model_here(config: EngineConfig) -> None:
    """When Ray would start on this machine, the model must be here: say so before Ray starts (13-22 s
    of start-up otherwise, then a misleading tokenizer warning). On a cluster it may live on the nodes
    only (token-id prompts still work then)."""
    from actors.executor.node_probe import resolve_model_dir
    from cluster.replicas.placement import embedded_ray

    if embedded_ray(config):
        try:
            resolve_model_dir(config.model.model)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"model.model: {e}") from None


def load_client_model(config: EngineConfig) -> tuple[Any, dict[str, Any] | None]:
    """The tokenizer and config.json as this client sees them (None where the model is not local)."""
    from actors.config.hf_json import read_config_json
    from actors.models.model_dir import resolve_model_dir
    from cluster.client.tokenizer import load_tokenizer_if_present

    try:
        model_dir = resolve_model_dir(config.model.model)
    except FileNotFoundError:
        # The model may live only on the cluster's nodes: token-id prompts still work.
        logger.warning("model %r is not on this machine: text prompts need a tokenizer", config.model.model)
        return None, None
    return load_tokenizer_if_present(model_dir), read_config_json(model_dir)


def client_model_dir(config: EngineConfig) -> str | None:
    from actors.models.model_dir import resolve_model_dir

    try:
        return resolve_model_dir(config.model.model)
    except FileNotFoundError:
        return None


def check_client_model(config: EngineConfig, hf_config: dict[str, Any]) -> None:
    """Fail on this machine, before any actor starts, when the config cannot run this model."""
    from actors.models.architectures import supported_architecture

    validate_for_model(config, hf_config)
    supported_architecture(hf_config)  # an unsupported architecture names itself and the supported ones


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        config: EngineConfig | None = None,
        worker_cls: str = DEFAULT_WORKER_CLS,
        **kwargs: Any,
    ) -> None:
        if config is None:
            config = EngineConfig()
        if model is not None:
            kwargs["model"] = model
        self.config = apply_overrides(config, kwargs) if kwargs else config
        check_model_here(self.config)
        self.tokenizer, hf_config = load_client_model(self.config)
        self.model_dir = client_model_dir(self.config) if hf_config is not None else None
        # Read now, so a bad generation_config.json fails here rather than at the first generate.
        self._default_params = default_sampling_params(self.model_dir)
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
                raise PromptError(
                    f"prompts[{index}]: a dict prompt holds exactly one of 'prompt' or "
                    f"'prompt_token_ids', got keys {sorted(keys)}"
                )
        if not isinstance(prompt, str):
            raise PromptError(f"prompts[{index}]={prompt!r}: must be a str or a dict with 'prompt_token_ids'")
        err = check_text(f"prompts[{index}]", prompt)
        if err is not None:
            raise PromptError(err)
        if self.tokenizer is None:
            raise PromptError(
                f"prompts[{index}]: text prompt, but the model has no tokenizer.json here; "
                f"pass {{'prompt_token_ids': [...]}} instead"
            )
        return prompt, self.tokenizer.encode(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    # ---- generate and chat ------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        """The model's tokenizer as vLLM's LLM.get_tokenizer() gives it: transformers' PreTrainedTokenizerFast
        over the model's tokenizer.json (built on first call, no checkpoint code run); None where the model
        has no tokenizer on this machine."""
        return self._user_tokenizer

    @functools.cached_property
    def _user_tokenizer(self) -> Any:
        from cluster.client.tokenizer import hf_tokenizer

        model_dir = getattr(self.tokenizer, "model_dir", None)
        return hf_tokenizer(model_dir) if model_dir else self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate/chat use without sampling_params: the model's generation_config.json, else vLLM's."""
        return self._default_params

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        encoded: list[Encoded] = []
        for i, prompt in enumerate(prompts):
            try:
                encoded.append(self.encode(i, prompt))
            except PromptError as e:
                encoded.append(EncodeError(prompt if isinstance(prompt, str) else None, str(e)))
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, rendered with the model's chat
        template (or `chat_template`), then generated as LLM.generate does; one output per conversation.
        continue_final_message (HF's and vLLM's): the model continues the last message (needs
        add_generation_prompt=False)."""
        check_chat_flags(add_generation_prompt, continue_final_message)
        if self.tokenizer is None:
            raise PromptError("LLM.chat: the model has no tokenizer.json on this machine")
        template = resolve_chat_template(self.tokenizer.model_dir, chat_template)
        tokens = special_tokens(self.tokenizer.model_dir) if self.tokenizer.model_dir else {}
        conversations, _ = as_conversations(messages)
        encoded: list[Encoded] = []
        for conv in conversations:
            try:
                text = render_chat(
                    conv,
                    template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tokens=tokens,
                    tools=tools,
                    **(chat_template_kwargs or {}),
                )
            except ChatTemplateError as e:
                encoded.append(EncodeError(None, str(e)))
                continue
            # The template placed the special tokens itself (as vLLM's LLM.chat tokenizes).
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, sampling_params, use_tqdm)

    def _run(self, encoded: list[Encoded], sampling_params: Any, use_tqdm: bool) -> list[RequestOutput]:
        if self.engines is None:
            raise RuntimeError("LLM.generate: this LLM is shut down")
        params = _params_list(sampling_params, len(encoded), self.get_default_sampling_params)
        processor = OutputProcessor(self.tokenizer)
        results: list[RequestOutput | None] = [None] * len(encoded)
        index_of: dict[str, int] = {}
        specs: list[RequestSpec] = []
        for i, (enc, sp) in enumerate(zip(encoded, params, strict=True)):
            rid = str(next(self._ids))
            if isinstance(enc, EncodeError):
                results[i] = error_output(rid, enc.prompt, [], enc.message)
                continue
            text, ids = enc
            err = self._unsupported(sp)
            if err is not None:
                results[i] = error_output(rid, text, ids, err)
                continue
            _, subs = processor.add_request(rid, text, ids, sp)
            index_of[rid] = i
            specs.extend(RequestSpec(child_id, ids, child_sp) for child_id, child_sp in subs)
        collect = _Collect(self.engines, processor, specs, results, index_of)
        collect.bar = _progress(len(index_of), use_tqdm)
        try:
            collect.loop()
        finally:
            if collect.bar is not None:
                collect.bar.close()
        done = [r for r in results if r is not None]
        assert len(done) == len(results)  # every prompt ends with an output or an error output
        return done

    def _unsupported(self, sp: SamplingParams) -> str | None:
        """A request this client or engine cannot serve as asked (never silently ignored)."""
        if (sp.logprobs is not None or sp.prompt_logprobs is not None) and not engine_computes_logprobs():
            return "SamplingParams.logprobs/prompt_logprobs: this engine does not compute logprobs yet"
        if sp.stop and self.tokenizer is None:
            return f"SamplingParams.stop={sp.stop!r}: stop strings need the model's tokenizer.json on this machine"
        return None

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


class _Collect(ProcessedStream):
    """LLM.generate's requests, submitted at once; each request's output lands at its prompt's index."""

    poll_s = 1.0

    def __init__(
        self,
        engines: EngineGroup,
        processor: OutputProcessor,
        specs: list[RequestSpec],
        results: list[RequestOutput | None],
        index_of: dict[str, int],
    ) -> None:
        super().__init__(engines, processor)
        self.specs: list[RequestSpec] | None = specs
        self.results, self.index_of = results, index_of
        self.bar: Any = None

    def due(self) -> list[RequestSpec] | None:
        specs, self.specs = self.specs, None
        return specs or None

    def in_flight(self) -> int:
        return int(self.processor.has_unfinished())

    def finished(self, parent: ParentRequest, refused: bool) -> None:
        self.results[self.index_of[parent.request_id]] = parent.output()
        if not refused and self.bar is not None:
            self.bar.update(1)


@dataclass
class EncodeError:
    prompt: str | None
    message: str


Encoded = Union[tuple[Optional[str], list[int]], EncodeError]  # a prompt's (text, token ids), or why not


def _params_list(sp: Any, n: int, default: Callable[[], SamplingParams]) -> list[SamplingParams]:
    if sp is None:
        return [default()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sp = list(sp)
    if len(sp) != n:
        raise ValueError(f"sampling_params: got a list of {len(sp)} for {n} prompts; give one, or one per prompt")
    for i, p in enumerate(sp):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}]={p!r}: must be a SamplingParams")
    return sp


def _progress(total: int, enabled: bool) -> Any:
    if not enabled or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")


__all__ = [
    "LLM",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "PromptError",
    "ChatTemplateError",
    "ConfigError",
    "EngineFailure",
]
