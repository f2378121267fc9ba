"""A run on several trainer ranks: rank 0 runs the whole system and announces each collective
step (`commands`), the other ranks follow (`follower`), started by torch's launcher
(`launcher`, `python -m rollover.ranks`). It sits beside `rollover.launch`, above the parts it
drives; the rank primitives it uses are `rollover.distributed`."""
