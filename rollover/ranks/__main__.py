"""One trainer rank, as torch's launcher starts it:

    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m rollover.ranks CONFIG [key=value ...]

Rank 0 runs the whole system (`rollover.launch`); the others follow its commands.
"""

from __future__ import annotations

from rollover.cli.logs import configure_logging
from rollover.ranks.rank import exit_rank, main

if __name__ == "__main__":
    configure_logging()
    exit_rank(main())
