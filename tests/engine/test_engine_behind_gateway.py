"""vLLM behind the real gateway: recorded calls carry token ids, logprobs and the policy
version; a weight update changes greedy output and the version."""

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollover.engine.weights import save_weights
from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread
from tests.conftest import ADMIN_KEY

pytestmark = pytest.mark.vllm
PROMPT = [{"role": "user", "content": "What is 12+30?"}]


def running_rollout(gateway):
    admin = httpx.Client(base_url=gateway.url, headers={"x-api-key": ADMIN_KEY}, timeout=60)
    rid = admin.post("/api/rollouts", json=[{"input": {}}]).json()[0]["rollout_id"]
    admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "a1"}})
    return admin, rid


def call(gateway, rid, mode="val", **extra):
    url = f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/{mode}/openai/v1/chat/completions"
    body = {"messages": PROMPT, "max_tokens": 12, **extra}
    return httpx.post(
        url, json=body, headers={"Authorization": f"Bearer {scoped_key(ADMIN_KEY, rid, 'a1')}"}, timeout=120
    )


async def test_recorded_calls_and_weight_update_through_the_gateway(vllm_engine, tiny_model_dir, tmp_path):
    with GatewayThread(admin_key=ADMIN_KEY) as gateway:
        await vllm_engine.register_with_gateway(gateway.url, ADMIN_KEY)
        vllm_engine.attach_gateway(gateway.url, ADMIN_KEY)
        admin, rid = running_rollout(gateway)
        try:
            before = call(gateway, rid).json()["choices"][0]["message"]["content"]
            train_reply = call(gateway, rid, mode="train")
            assert train_reply.status_code == 200
            # vLLM names its answer after the request id the gateway gave it: the call's id.
            assert train_reply.json()["id"] == "chatcmpl-" + train_reply.headers["x-agl-call-id"]
            [_, train_event] = admin.get(f"/api/rollouts/{rid}/events").json()
            data = train_event["data"]
            version_before = data["policy_version"]
            assert version_before == vllm_engine.policy_version
            assert data["prompt_token_ids"] and data["response_token_ids"]
            assert len(data["response_logprobs"]) == len(data["response_token_ids"])
            assert all(lp <= 0 for lp in data["response_logprobs"])

            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter) * 0.5)
            version = await vllm_engine.load_weights(save_weights(model, tmp_path / "perturbed"))
            after = call(gateway, rid).json()["choices"][0]["message"]["content"]
            assert after != before  # greedy output follows the new weights
            call(gateway, rid, mode="train")
            last = admin.get(f"/api/rollouts/{rid}/events").json()[-1]["data"]
            assert last["policy_version"] == version == version_before + 1
        finally:
            await vllm_engine.load_weights(tiny_model_dir)
            vllm_engine.gateway_url = None


async def test_a_streamed_call_is_relayed_from_vllm_and_recorded_with_token_ids_and_logprobs(vllm_engine):
    with GatewayThread(admin_key=ADMIN_KEY) as gateway:
        await vllm_engine.register_with_gateway(gateway.url, ADMIN_KEY)
        admin, rid = running_rollout(gateway)
        reply = call(gateway, rid, mode="train", stream=True)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        payloads = [line[len("data: ") :] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        streamed_ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
        # How many tokens a chunk carries is vLLM's choice (it merges what the server has not sent
        # yet); that chunks are relayed as they come is tested on the stand-in upstream.
        assert streamed_ids and all(c["object"] == "chat.completion.chunk" for c in chunks)
        text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
        [event] = admin.get(f"/api/rollouts/{rid}/events").json()
        data = event["data"]
        assert data["response_token_ids"] == streamed_ids and data["prompt_token_ids"]
        assert len(data["response_logprobs"]) == len(streamed_ids)
        assert all(lp <= 0 for lp in data["response_logprobs"])
        assert data["policy_version"] == vllm_engine.policy_version
        assert (data["response"]["choices"][0]["message"]["content"] or "") == text
