"""Elastic torchrun agents on this host: the local launcher and what it needs.

    python -m elastic_qa.launcher.local start|join|leave|stop|status ...   (launch/local.sh in a checkout)

local.py is the command; rendezvous.py holds the rendezvous settings and their trade-offs; loopback.py
runs torchrun and every worker with the TCP stores they host bound to loopback; processes.py finds the
job's processes. The core packages never import this one.
"""
