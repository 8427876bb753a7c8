"""The first releases' planning command, ``python -m common.perf.plan``: it runs
``python -m common.perf`` (:mod:`common.perf.cli`) with the same arguments and a
DeprecationWarning that names it.

Imported rather than run, this module gives way to the function it would shadow: a submodule
named ``plan`` would replace :func:`common.perf.plan` (:func:`common.perf.choose.plan`) as an
attribute of the package once imported, so it puts that function in its own place in
``sys.modules`` and ``common.perf.plan`` stays the function whatever was imported first.
"""

import sys
import warnings

from common.perf.choose import plan

NEW_COMMAND = "python -m common.perf"

if __name__ == "__main__":
    warnings.warn(f"python -m common.perf.plan is deprecated: run {NEW_COMMAND} with the same "
                  f"arguments (e.g. {NEW_COMMAND} gcn --dataset ogbn-products --ranks 64)",
                  DeprecationWarning, stacklevel=1)
    from common.perf.cli import main

    sys.exit(main())
else:
    # the import system binds the package attribute to whatever sys.modules holds afterwards
    sys.modules[__name__] = plan  # type: ignore[assignment]
