"""``python -m plexus.prepare``: write a graph as k x k block files (see plexus.data.prepare)."""

import sys

from plexus.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
