"""Logprobs on the scheduler's outputs: each output gets the rows the runner computed for its request."""
from __future__ import annotations

from kvcore.messages import EngineCoreOutput, ModelRunnerOutput


def attach_logprobs(outputs: list[EngineCoreOutput], model_runner_output: ModelRunnerOutput) -> None:
    """Hand each output the logprobs the runner computed for its request this step (the sampler's)."""
    sampled = model_runner_output.logprobs or {}
    prompt = model_runner_output.prompt_logprobs or {}
    for o in outputs:
        if o.new_token_ids:
            lp = sampled.get(o.request_id)
            if lp is not None:
                # a stop inside a multi-token step keeps only the rows of the tokens kept
                o.logprobs = lp if len(lp) == len(o.new_token_ids) else lp.head(len(o.new_token_ids))
            o.prompt_logprobs = prompt.get(o.request_id, o.prompt_logprobs)

