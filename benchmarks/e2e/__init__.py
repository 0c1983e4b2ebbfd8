"""The whole engine (LLM, kvray run, kvray serve): throughput, latency, start-up, GPU idle."""
