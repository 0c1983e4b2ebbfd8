"""The KV-cache manager's machinery: the block pool and prefix-cache map, block hashing, one single-type
manager per KV-cache group and the coordinator that drives them (kvcore/kv_cache_manager.py is the door)."""
