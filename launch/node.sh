#!/usr/bin/env bash
# One host's part of a multi-node job, from a checkout: `elastic-qa node` with the checkout's .venv (else
# python3, or $PYTHON) and the checkout's code first on PYTHONPATH. `launch/node.sh --help` for the flags.
#   launch/node.sh --endpoint 10.0.0.1:29400 --nnodes 1:4 --nproc-per-node 8 [--store-host] [key=value ...]
#   launch/node.sh --replicas --group N --endpoint 10.0.0.1:29510 [--store-host] [key=value ...]   (replica groups)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
[ -x "$here/../.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && python="$here/../.venv/bin/python"
checkout="$(dirname "$here")"
export PYTHONPATH="$checkout${PYTHONPATH:+:$PYTHONPATH}"
module=elastic_qa.launcher.node
for arg in "$@"; do [ "$arg" = --replicas ] && module=elastic_qa.replica.node; done  # a replica group
exec "$python" -m "$module" "$@"
