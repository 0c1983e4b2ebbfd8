"""`kvray stress`: a hostile workload over every replica, worker and node kills, the reference run and
the verdict."""
