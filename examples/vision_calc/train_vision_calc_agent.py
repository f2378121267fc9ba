"""Train the vision calc agent: `python examples/vision_calc/train_vision_calc_agent.py [--async] [key=value ...]`.

`--async` turns on collocated asynchronous rollout with the recommended window,
async_train_batch_size = 2 * train_batch_size.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.launcher import example_main

if __name__ == "__main__":
    sys.exit(example_main(Path(__file__).with_name("config.yaml"), __doc__))
