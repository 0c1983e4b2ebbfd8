"""The control-plane broadcast of each step to every rank: Ray actor calls, a compiled graph, or the
shared-memory ring (with ZMQ across nodes) and its codec."""
