"""`python -m chaos` in a checkout: a shim for `elastic-qa chaos` (the code is elastic_qa.chaos).

Not packaged: an installed wheel must not claim the generic top-level name `chaos`.
"""
