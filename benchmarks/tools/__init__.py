"""Helpers that measure nothing: trace summaries, the GPU bundle's extras, tile picks."""
