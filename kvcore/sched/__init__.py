"""The scheduler's machinery: the continuous-batching scheduler, its book of live requests, admission,
stopping, the async (overlapped) step hooks and the logprobs it attaches to outputs. Tensor-free."""
