"""kvray's benchmarks and GPU checks: scripts by role (kernels/, e2e/, host/, checks/, tools/), the named suites
of suites.yaml that run them (`python -m benchmarks --list`), and common.py's one result writer."""
