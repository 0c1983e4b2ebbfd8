"""Host-side costs with no model or no GPU: control plane, scheduler, runner, logprobs path, job client."""
