"""Results: environment capture, records, atomic store."""
