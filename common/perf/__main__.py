"""``python -m common.perf``: the planning command (:mod:`common.perf.cli`)."""

import sys

from common.perf.cli import main

sys.exit(main())
