"""A user's Agent Lightning YAML starts a Rollover run: Agent Lightning's own default
config (read from the installed package, where a user copies it from) plus the overrides an
Agent Lightning user writes, dotted agent class included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollover.config import load_config
from rollover.engine.weights import INDEX_FILE
from rollover.processes import free_port
from rollover.store import RolloutStore
from tests.runs import train_briefly

AGENT = "tests.agent_lightning_compat.agents.AskOnce"  # Agent Lightning's pkg.module.Class form


def agl_yaml(agl_package_dir: Path) -> Path:
    path = agl_package_dir / "verl" / "config.yaml"
    assert path.is_file(), f"Agent Lightning's default config is not at {path}"
    return path


def test_agent_lightning_default_config_loads(agl_package_dir, caplog):
    with caplog.at_level("WARNING", logger="rollover.config"):
        config = load_config(agl_yaml(agl_package_dir), [f"agentlightning.local.agent_class={AGENT}"])
    assert (config.gateway.host, config.gateway.port) == ("localhost", 8080)  # its agl_base_url
    assert config.gateway.admin_key is None  # agl_key "" = no key: Rollover generates one
    assert config.agentlightning.local.agent_class == AGENT
    assert config.agentlightning.trace_aggregator.level == "trajectory"
    # its defaults mean the same here: per_rollout_mean is the loss, entropy is computed
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "per_rollout_mean"
    assert config.actor_rollout_ref.actor.calculate_entropy is True
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "'hydra', 'defaults'" in warned[0], warned


@pytest.mark.vllm
def test_agent_lightning_config_starts_a_run(agl_package_dir, tmp_path, calc_model, vllm_engine):
    tasks = tmp_path / "train.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"{i} + {i} = ?"}) + "\n" for i in range(4)))
    port = free_port()
    train, _ = train_briefly(
        agl_yaml(agl_package_dir),
        tmp_path,
        calc_model,
        "agl",
        1,
        f"data.train_files={tasks}",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        f"agentlightning.agl_base_url=http://127.0.0.1:{port}",
        "agentlightning.agl_key=agl-user-key",
        f"agentlightning.local.agent_class={AGENT}",
        "agentlightning.local.env_map.QUESTION=input.question",
        "agentlightning.async_rollout.enabled=true",
        "agentlightning.async_rollout.async_train_batch_size=4",
        "trainer.logger=[jsonl]",
        # science_world and swe_smith set it: the synced weights come in files of at most 1 MiB
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1",
        engine=vllm_engine,
    )
    assert train[0]["training/async/n_completed_rollouts"] == 4
    [synced] = (tmp_path / "agl" / "weights" / "node0").iterdir()
    assert len(set(json.loads((synced / INDEX_FILE).read_text())["weight_map"].values())) > 1
    assert train[0]["critic/score/mean"] == 1.0 and train[0]["rollouts/n_samples"] >= 4
    store = RolloutStore(tmp_path / "agl" / "store.db")
    try:
        import asyncio

        async def base_urls() -> list[str]:
            rollouts = await store.list_rollouts()
            events = [e for r in rollouts for e in await store.list_events(r.rollout_id, event_type="env")]
            return [e.data["base_url"] for e in events]

        urls = asyncio.run(base_urls())
    finally:
        store.close()
    # the agents reached the gateway where agl_base_url put it
    assert urls and all(url.startswith(f"http://127.0.0.1:{port}/proxy/rollout/") for url in urls)
