"""``python -m runtime.model.kernels``: build pie-ctx's CPU kernels ahead of time."""

import logging
import sys
import time

from runtime.model.kernels import BLOCK_SOURCE, SAMPLING_SOURCE, build, folder

logging.basicConfig(level=logging.INFO)
t = time.perf_counter()
try:
    build()
    build(source=BLOCK_SOURCE)
    build(source=SAMPLING_SOURCE)
except Exception as err:  # report, and let setup go on: the eager code is the fallback
    print(f"pie-ctx CPU kernels did not build ({err}); decode will use PyTorch ops",
          file=sys.stderr)
else:
    print(f"pie-ctx CPU kernels ready in {folder()} ({time.perf_counter() - t:.1f} s)")
