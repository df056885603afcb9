"""``python -m pie_ctx ARGS`` is the ``pie-ctx`` command (also what every rank runs under
``torchrun``, see docs/scale-out.md)."""

import sys

from runtime.cli import main

sys.exit(main())
