"""Train the harness example through the OpenAI Agents SDK: `python examples/harness/train_agents_sdk_agent.py [--async] [key=value ...]`.

`--async` sets the recommended window, async_train_batch_size = 2 * train_batch_size (the
config already runs async with that window).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.launcher import example_main

if __name__ == "__main__":
    sys.exit(example_main(Path(__file__).with_name("config_agents_sdk.yaml"), __doc__))
