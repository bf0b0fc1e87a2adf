"""Measurement: timers, statistics, memory, communication, instrumentation."""
