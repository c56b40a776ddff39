"""MPI plumbing: where each rank sits (cluster), the wire format (protocol), bounded waits and
failure detection (liveness), polite polling (backoff)."""
