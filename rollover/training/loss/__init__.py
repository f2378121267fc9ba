"""The loss maths of a policy update, as small pure functions over ``[B, T]`` tensors.

Set beside verl's ``verl/trainer/ppo/core_algos.py`` and ``rollout_corr_helper.py``:

- ``pg``: per-token policy-gradient losses (``ppo_clip`` with dual clip and clip-higher,
  ``reinforce``, ``gspo``, ``cispo``, ``sapo``, ``gpg``, ``clip_cov``, ``kl_cov``, ``geo_mean``);
- ``covariance``: the tokens clip_cov and kl_cov single out;
- ``aggregate``: ``loss_agg_mode`` over a mini-batch split into micro-batches and ranks, and
  Agent Lightning's ``per_rollout_mean``;
- ``kl``: KL-to-reference estimators and the KL-in-reward coefficient controllers;
- ``entropy``: chunked per-token entropy from logits;
- ``correction``: rollout correction, IS weights and rejection sampling;
- ``masked``: the masking helpers they share.
"""
