"""``python -m runtime ARGS`` is the ``pie-ctx`` command (also what every rank runs under
``torchrun``, see docs/scale-out.md).

The program lives in ``runtime``, at the top of the import order, so the SDK package
``pie_ctx`` imports nothing of the command line that sits above it.
"""

import sys

from runtime.cli import main

sys.exit(main())
