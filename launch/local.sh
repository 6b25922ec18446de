#!/usr/bin/env bash
# Elastic torchrun agents on this host, from a checkout: `python -m elastic_qa.launcher.local` with the
# checkout's .venv (else python3, or $PYTHON) and the checkout's code first on PYTHONPATH.
# `launch/local.sh --help` for the commands.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
[ -x "$here/../.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && python="$here/../.venv/bin/python"
checkout="$(dirname "$here")"
export PYTHONPATH="$checkout${PYTHONPATH:+:$PYTHONPATH}"
# The launcher names itself as typed here in its help and in the resume command it prints.
export ELASTIC_QA_PROG="${ELASTIC_QA_PROG:-$0}"
exec "$python" -m elastic_qa.launcher.local "$@"
