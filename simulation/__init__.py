"""Simulation mode: the coordinator, a GPU server and many edge clients in one process, on the
deployment's code paths, with the splitfed, fedavg and centralized baselines beside them.

Only the CLI and the benchmarks import this package; it imports the roles.
"""
