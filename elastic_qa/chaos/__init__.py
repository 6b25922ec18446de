"""Chaos tooling: break a real job on this host, then verify from evidence that nothing was lost.

`elastic-qa chaos run|verify|schedule` (or `python -m chaos` in a checkout). It drives the local launcher
(`python -m elastic_qa.launcher.local`) as a subprocess and reads what the run left behind; it imports the
core packages, never the other way round.
"""
