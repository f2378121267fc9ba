"""One trainer rank for test_timeouts.py, started by torch's launcher:

    python -m torch.distributed.run --standalone --nproc-per-node 2 timeout_worker.py \\
        NCCL_TIMEOUT_S ACTION REPORT

Both actions init the process group as `rollover.ranks` does (`World`, the timeout from
`trainer.nccl_timeout`) and build the `CommandChannel`; rank 0 writes REPORT (JSON).
ACTION `read`: the timeouts torch holds for the default group and the channel's group.
ACTION `wait`: rank 0 sends its command late (GAP_S, over twice the training timeout), then
stays out of a collective rank 1 enters on the default group; rank 1 reports both waits.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rollover.config import load_config
from rollover.distributed.world import World
from rollover.ranks.commands import CommandChannel, Stop

GAP_S = 2.5  # x trainer.nccl_timeout


def start_together(world: World) -> None:
    """A barrier on the launcher's store before the process group exists, so the short
    timeout under test is not spent waiting for the other rank to finish importing."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=120),
    )
    store.add("timeout-test/ready", 1)
    while int(store.add("timeout-test/ready", 0)) < world.size:
        time.sleep(0.01)


def timeout_s(group: dist.ProcessGroup) -> float:
    return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())


def main(nccl_timeout: str, action: str, report_path: str) -> None:
    config = load_config(None, ["trainer.device=cpu", f"trainer.nccl_timeout={nccl_timeout}"])
    world = World.from_env()
    start_together(world)
    world.init_process_group(torch.device("cpu"), timeout_s=config.trainer.nccl_timeout)
    channel = CommandChannel()
    report: dict[str, object] = {}
    if action == "read":
        report = {
            "default_group_s": timeout_s(dist.distributed_c10d._get_default_group()),
            "channel_group_s": timeout_s(channel.group),
        }
    elif world.is_leader:
        time.sleep(GAP_S * config.trainer.nccl_timeout)
        channel.send(Stop("late"))
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=1, group=channel.group)  # rank 1's report; no default-group call
        assert isinstance(box[0], dict)
        report = box[0]
    else:
        started = time.monotonic()
        command = channel.receive()
        waited = time.monotonic() - started
        started = time.monotonic()
        try:
            dist.all_reduce(torch.zeros(1))  # rank 0 never joins it
            error = None
        except RuntimeError as exc:
            error = str(exc)
        dist.broadcast_object_list(
            [
                {
                    "command": repr(command),
                    "command_waited_s": waited,
                    "collective_error": error,
                    "collective_failed_after_s": time.monotonic() - started,
                }
            ],
            src=1,
            group=channel.group,
        )
    if world.is_leader:
        Path(report_path).write_text(json.dumps(report))
    world.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
