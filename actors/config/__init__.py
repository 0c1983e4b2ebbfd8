"""Engine configuration: the typed config sections and their rules, the model's JSON files read as
untrusted input, the rules that need config.json, and what the KV cache holds for a model."""
