"""Records: atomic writes, the record and its fingerprint, the environment, the typed metrics, the one reader."""
