"""`python -m chaos ...` from a checkout's root: the same as `elastic-qa chaos ...`."""

import sys

from elastic_qa.chaos.cli import main

sys.exit(main())
