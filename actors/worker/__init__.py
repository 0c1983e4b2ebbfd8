"""One rank: the worker actor, its model runner (persistent batch, inputs, forward, CUDA graphs), KV-cache
sizing, warm-up and the readback of sampled tokens; plus the no-op worker for control-plane tests."""
