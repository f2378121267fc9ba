"""Train the smith agent: `python examples/smith/train_smith_agent.py [--async] [key=value ...]`.

The config presets collocated asynchronous rollout with the recommended window,
async_train_batch_size = 2 * train_batch_size; `--async` recomputes that window from the
(possibly overridden) data.train_batch_size.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.launcher import example_main

if __name__ == "__main__":
    sys.exit(example_main(Path(__file__).with_name("config.yaml"), __doc__))
