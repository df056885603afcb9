"""``torchrun --nproc-per-node N -m runtime.distributed serve --tensor-parallel N ...``:
rank 0 runs the ``pie-ctx`` command line, the other ranks serve as its workers."""

import sys

from runtime.distributed.launch import main

sys.exit(main(sys.argv[1:]))
