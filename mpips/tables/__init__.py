"""Parameter storage without MPI: the paged sparse table, the dense table, optimizers, admission,
staleness rules and key ownership. Used by servers, workers and the one-process backend alike."""
