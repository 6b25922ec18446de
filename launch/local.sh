#!/usr/bin/env bash
# Elastic torchrun agents on this host. `launch/local.sh --help` for the commands.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
[ -x "$here/../.venv/bin/python" ] && [ -z "${PYTHON:-}" ] && python="$here/../.venv/bin/python"
exec "$python" "$here/local.py" "$@"
