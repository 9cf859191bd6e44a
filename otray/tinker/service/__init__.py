"""The TinkerService actor (one, named and detached) and the state it owns: training clients and their
ordered requests, sessions, futures, leases, the catalog and its SQLite store, sampling sessions and
their batching, merges, external weights, uploaded custom losses.

Runs in the TinkerService actor.
"""
