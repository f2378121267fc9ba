"""Two of Agent Lightning's own example configs, as Agent Lightning writes them (base ← example,
scaled down to this CPU machine), train the calc agent for 2 updates: calc_x's (clip-higher,
per_rollout_mean, Agent Lightning's base) and search_r1's (KL to a frozen reference policy,
low_var_kl, 0.001)."""

from __future__ import annotations

import pytest

from examples.calc.task import make_tasks
from rollover.processes import free_port
from rollover.training.data import write_tasks
from tests.agent_lightning_compat.example_configs import scaled_down, write_config
from tests.runs import train_briefly

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("name", ["calc_x", "search_r1"])
def test_an_agent_lightning_example_config_trains_the_calc_agent(name, tmp_path, calc_model, vllm_engine):
    tasks = write_tasks(tmp_path / "train.jsonl", make_tasks(16, seed=1))
    config = scaled_down(
        name,
        model_dir=calc_model,
        train_file=tasks,
        agent_class="examples.calc.agent:CalcAgent",
        env_map={},
        runs_dir=tmp_path,
        agl_base_url=f"http://127.0.0.1:{free_port()}",
        steps=2,
        train_batch_size=4,  # 4 groups x 4: some group has signal (one with every reward alike has none)
    )
    train, _ = train_briefly(
        write_config(config, tmp_path / f"{name}.yaml"),
        tmp_path,
        calc_model,
        name,
        2,
        "trainer.val_before_train=false",
        engine=vllm_engine,
    )
    actor = config["actor_rollout_ref"]["actor"]
    for row in train:
        assert row["training/update_skipped"] == 0.0
        assert row["actor/entropy"] > 0 and "actor/pg_clipfrac_lower" in row
    if name == "search_r1":  # KL to the reference as a loss term, at Agent Lightning's coefficient
        assert actor["use_kl_loss"] is True and actor["kl_loss_type"] == "low_var_kl"
        assert all(row["actor/kl_coef"] == 0.001 for row in train)
        # 0 until the first optimizer step moves π_θ off π_ref, then positive
        assert all(row["actor/kl_loss"] >= 0 for row in train) and sum(row["actor/kl_loss"] for row in train) > 0
    else:
        assert actor["clip_ratio_high"] == 0.3 and "actor/kl_loss" not in train[0]
