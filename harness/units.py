"""Binary byte units, one definition for the whole harness (metric names say which they use)."""

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
