"""Parallel strategies: degrees, one apply_<strategy> per strategy, parallelize()."""
