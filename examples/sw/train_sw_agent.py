"""Train the ScienceWorld agent: `python examples/sw/train_sw_agent.py [--async] [key=value ...]`.

The config presets collocated asynchronous rollout with a window of 2 x train_batch_size
(ScienceWorld episodes are long-tailed); `--async` sets the same ratio, computed from the
(possibly overridden) batch.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.launcher import example_main

if __name__ == "__main__":
    sys.exit(example_main(Path(__file__).with_name("config.yaml"), __doc__))
