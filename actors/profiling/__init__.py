"""Where a worker's time goes: start-up timeline, compiled kernel variants, and a torch profiler around
steps."""
