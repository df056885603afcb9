"""``python -m runtime.distributed.worker RANK WORLD PORT DEVICE TIMEOUT``: one worker rank
started by rank 0 (``runtime.distributed.launch.start_ranks``); not for users to run."""

import sys

from runtime.distributed.launch import worker_main

if __name__ == "__main__":
    rank, world, port, device, timeout = sys.argv[1:6]
    sys.exit(worker_main(int(rank), int(world), int(port), device, float(timeout)))
