"""A run from its Config to its records: factories (build), the epoch and stream loops, the local and
distributed backends, resume points, reports, progress and kernel warm-up."""
