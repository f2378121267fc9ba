"""`rollover train` on one node with several ranks: torch's own elastic launcher
(`torch.distributed.run`, what `torchrun` runs) starts `python -m rollover.ranks` once
per rank with a standalone rendezvous on loopback."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def launch_single_node(n_ranks: int, config_path: str | None, overrides: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    argv = ["--standalone", f"--nproc-per-node={n_ranks}", "--max-restarts=0", "-m", "rollover.ranks"]
    argv += [*([config_path] if config_path else []), *overrides]
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        failures = "; ".join(
            f"rank {rank} exit code {failure.exitcode}" for rank, failure in sorted(exc.failures.items())
        )
        print(f"rollover train: a trainer rank failed ({failures})", file=sys.stderr)
        first = min(exc.failures.items())[1].exitcode
        return first if first in (1, 2) else 1
    return 0
