"""The driver actor of one engine replica: the engine loop (scheduler + KV-cache manager over an
executor), its books on live requests, recovery from failed steps, the poison hunt, metrics and debug hooks."""
