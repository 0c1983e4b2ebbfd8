"""The client side of every request: tokenizer, chat templates, sampling defaults, incremental
detokenization, logprobs in vLLM's shape, the output processor and the one streaming loop."""
