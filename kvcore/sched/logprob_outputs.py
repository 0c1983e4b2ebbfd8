"""Logprobs on the scheduler's outputs: each output of a request that sampled points at the step's rows."""

from __future__ import annotations

from kvcore.messages import EngineCoreOutput, ModelRunnerOutput


def attach_logprobs(outputs: list[EngineCoreOutput], model_runner_output: ModelRunnerOutput) -> None:
    """Hand each output the step's logprob rows (one shared batch: the client reads its request's rows, as
    many as the output's new tokens, so a stop inside a multi-token step keeps the rows of the tokens kept)
    and, with its first token, the request's prompt logprobs."""
    batch, prompt = model_runner_output.logprobs, model_runner_output.prompt_logprobs
    if batch is not None:
        for o in outputs:
            if o.new_token_ids:
                o.step_logprobs = batch
    if prompt:
        for o in outputs:
            if o.new_token_ids:
                o.prompt_logprobs = prompt.get(o.request_id, o.prompt_logprobs)
