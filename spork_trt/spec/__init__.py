"""Speculation: token trees, drafters, the datastore, the early-layer verifier, verification, the scheduler."""
