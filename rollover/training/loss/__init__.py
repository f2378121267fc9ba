"""The loss maths of a policy update, as small pure functions over ``[B, T]`` tensors.

Set beside verl's ``verl/trainer/ppo/core_algos.py``:

- ``policy``: per-token policy losses (``ppo_clip`` with dual clip and clip-higher, ``reinforce``);
- ``aggregate``: ``loss_agg_mode`` over a mini-batch split into micro-batches and ranks, and
  Agent Lightning's ``per_rollout_mean``;
- ``kl``: KL-to-reference estimators and the KL-in-reward coefficient controllers;
- ``entropy``: chunked per-token entropy from logits;
- ``correction``: rollout correction, IS weights and rejection sampling;
- ``masked``: the masking helpers they share.
"""
