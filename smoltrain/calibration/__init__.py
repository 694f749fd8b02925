"""Measured compute: the probe that runs on each host and the cluster-wide calibration that
gathers its results into a `smoltrain.compute/1` report."""
