"""Pass/fail correctness checks (exit code 0 = pass), some with figures beside."""
