"""Chaos tooling: break a real job on this host, then verify from evidence that nothing was lost."""
