"""LoRA weight sync on a real vLLM engine: only the adapter is written and loaded per update
(the base stays), the engine serves it under a new name per version and drops the previous
one, its logprobs are the trainer's for the adapted model, and the gateway sends every call,
whatever model it names, to the current adapter with the exact version recorded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rollover.config import load_config
from rollover.engine.vllm_engine import VLLMEngine
from rollover.engine.weight_sync import EngineAdapterSync
from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread
from rollover.testing.engine import start_test_engine
from rollover.training import lora
from rollover.training.policy import Policy
from tests.conftest import ADMIN_KEY
from tests.engine.test_token_fidelity import PROMPTS

pytestmark = pytest.mark.vllm
RANK = 8
PROMPT = "What is 12 + 30?"


@pytest.fixture(scope="module")
def config():
    return load_config(None, ["trainer.device=cpu", f"actor_rollout_ref.model.lora_rank={RANK}"])


@pytest.fixture(scope="module")
def lora_engine(calc_model, config, tmp_path_factory):
    engine = start_test_engine(
        calc_model,
        log_path=tmp_path_factory.mktemp("vllm-lora-log") / "vllm.log",
        extra_args=config.actor_rollout_ref.rollout.vllm_flags(RANK),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    try:
        yield engine
    finally:
        engine.stop()


def perturb_adapter(policy: Policy, seed: int) -> None:
    """An update's worth of change, large enough to change greedy answers."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.3)


def chat(engine: VLLMEngine, model: str, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, **extra}
    resp = httpx.post(f"{engine.base_url}/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def greedy(engine: VLLMEngine, model: str) -> list[int]:
    return chat(engine, model, temperature=0.0, return_token_ids=True)["choices"][0]["token_ids"]


def served(engine: VLLMEngine) -> set[str]:
    return {m["id"] for m in httpx.get(f"{engine.base_url}/models", timeout=30).json()["data"]}


def max_logprob_gap(engine: VLLMEngine, model: torch.nn.Module) -> float:
    """The largest |engine − trainer| logprob over sampled tokens of the adapted model."""
    gaps: list[float] = []
    for i, prompt in enumerate(PROMPTS):
        body = chat(
            engine, engine.adapter_name or "", prompt, temperature=1.0, seed=i, logprobs=True, return_token_ids=True
        )
        prompt_ids, choice = body["prompt_token_ids"], body["choices"][0]
        ids = torch.tensor([prompt_ids + choice["token_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        for t, (token, entry) in enumerate(zip(choice["token_ids"], choice["logprobs"]["content"])):
            gaps.append(abs(entry["logprob"] - float(logp[len(prompt_ids) - 1 + t, token])))
    assert gaps
    return max(gaps)


def test_only_the_adapter_moves_and_the_engine_serves_it(lora_engine, calc_model, config, tmp_path):
    policy = Policy(calc_model, config)
    sync = EngineAdapterSync([lora_engine], tmp_path / "adapters")
    base_answer = greedy(lora_engine, lora_engine.served_model_name)
    served_before = served(lora_engine)

    perturb_adapter(policy, seed=1)
    asyncio.run(sync.sync(policy, 1))
    written = tmp_path / "adapters" / "v1"
    assert {p.name for p in written.iterdir()} == {lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS}
    from safetensors.torch import load_file

    tensors = load_file(written / lora.ADAPTER_WEIGHTS)
    assert tensors and all("lora_" in name for name in tensors)  # no base weight is written
    assert sync.last_bytes < (calc_model / "model.safetensors").stat().st_size / 4
    assert lora_engine.adapter_name == "policy-v1" and lora_engine.policy_version == 1
    assert served(lora_engine) == served_before | {"policy-v1"}

    adapted_answer = greedy(lora_engine, "policy-v1")
    assert adapted_answer != base_answer  # the engine's answers follow the adapter
    assert greedy(lora_engine, lora_engine.served_model_name) == base_answer  # the base never moved
    assert max_logprob_gap(lora_engine, policy.model.eval()) < 1e-3

    # Every version a new name, the previous one unloaded: max_loras=1 never runs out.
    for version in range(2, 6):
        perturb_adapter(policy, seed=version)
        asyncio.run(sync.sync(policy, version))
        assert served(lora_engine) == served_before | {f"policy-v{version}"}
        assert [p.name for p in (tmp_path / "adapters").iterdir()] == [f"v{version}"]
    assert greedy(lora_engine, "policy-v5") != adapted_answer
    assert max_logprob_gap(lora_engine, policy.model.eval()) < 1e-3


async def test_the_gateway_sends_every_call_to_the_current_adapter(lora_engine, calc_model, config, tmp_path):
    policy = Policy(calc_model, config)
    perturb_adapter(policy, seed=11)
    sync = EngineAdapterSync([lora_engine], tmp_path / "adapters")
    with GatewayThread(admin_key=ADMIN_KEY) as gateway:
        lora_engine.attach_gateway(gateway.url, ADMIN_KEY)
        try:
            await sync.sync(policy, 7)
            admin = httpx.Client(base_url=gateway.url, headers={"x-api-key": ADMIN_KEY}, timeout=60)
            rid = admin.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
            admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "a1"}})
            url = f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/val/openai/v1/chat/completions"
            headers = {"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}"}
            body = {"model": "any-name-the-agent-likes", "messages": [{"role": "user", "content": PROMPT}]}
            reply = httpx.post(url, json={**body, "max_tokens": 16}, headers=headers, timeout=120)
            assert reply.status_code == 200, reply.text
            event = admin.get(f"/api/rollouts/{rid}/events").json()[-1]["data"]
            assert event["policy_version"] == 7 and event["model"] == "policy-v7"
            assert event["response_token_ids"] == greedy(lora_engine, "policy-v7")

            perturb_adapter(policy, seed=12)
            await sync.sync(policy, 8)
            reply = httpx.post(url, json={**body, "max_tokens": 16}, headers=headers, timeout=120)
            assert reply.status_code == 200, reply.text
            event = admin.get(f"/api/rollouts/{rid}/events").json()[-1]["data"]
            assert event["policy_version"] == 8 and event["model"] == "policy-v8"
            assert event["response_token_ids"] == greedy(lora_engine, "policy-v8")
        finally:
            lora_engine.gateway_url = None


def test_a_restarted_engine_serves_the_adapter_it_served(lora_engine, calc_model, config, tmp_path):
    policy = Policy(calc_model, config)
    perturb_adapter(policy, seed=21)
    asyncio.run(EngineAdapterSync([lora_engine], tmp_path / "adapters").sync(policy, 9))
    answer = greedy(lora_engine, "policy-v9")
    asyncio.run(lora_engine.restart())
    assert lora_engine.adapter_name == "policy-v9" and "policy-v9" in served(lora_engine)
    assert greedy(lora_engine, "policy-v9") == answer


def test_a_whole_weights_load_makes_the_base_the_policy_again(lora_engine, calc_model: Path):
    asyncio.run(lora_engine.load_weights(calc_model))
    assert lora_engine.adapter_name is None and lora_engine.registration()[0]["model"] == "policy"


def test_a_lora_run_trains_resumes_and_exports(lora_engine, calc_model, tmp_path):
    """`rollover train` with lora_rank > 0 on the calc example: checkpoints hold the adapter,
    the engine serves each version's adapter, a resumed run goes on from the adapter it saved,
    and `rollover model merge` exports the last one as a plain model."""
    from transformers import AutoModelForCausalLM

    from rollover.cli.main import main
    from tests.runs import train_briefly

    calc = Path(__file__).resolve().parents[2] / "examples" / "calc" / "config.yaml"
    lora_keys = [f"actor_rollout_ref.model.lora_rank={RANK}", "actor_rollout_ref.actor.optim.lr=1e-3"]
    # Plumbing, not learning: no zero-variance filter (its top-up groups cost extra rollouts).
    small = ["data.val_batch_size=8", "trainer.test_freq=-1", "algorithm.filter_groups.enable=false", *lora_keys]
    train, _ = train_briefly(calc, tmp_path, calc_model, "lora", 2, *small, engine=lora_engine)
    assert [r["policy/version"] for r in train] == [0, 1]
    run = tmp_path / "lora"
    step_2 = run / "checkpoints" / "step_2" / "model"
    assert {p.name for p in step_2.iterdir()} >= {lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS}
    assert not (step_2 / "model.safetensors").exists()
    assert lora_engine.adapter_name == "policy-v2"
    [adapters] = (run / "weights").iterdir()
    assert [p.name for p in adapters.iterdir()] == ["v2"]  # only the served version is kept

    train, _ = train_briefly(calc, tmp_path, calc_model, "lora", 3, *small, "resume=true", engine=lora_engine)
    assert train[-1]["policy/version"] == 2  # the resumed step starts from the saved version
    assert lora_engine.adapter_name == "policy-v3"
    step_3 = run / "checkpoints" / "step_3"
    assert main(["model", "merge", str(step_3), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
