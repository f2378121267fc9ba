"""Harnesses people use, unchanged, through the real gateway: Claude Code's CLI (npm, installed by
`scripts/setup.sh --dev`), the OpenAI Agents SDK, the Anthropic SDK and the OpenAI SDK's
Responses calls.

Fast lane: each harness runs against the gateway in front of a scripted engine (what the
harness example's model build captures). With vLLM (`-m vllm`): the SDKs against the real
engine (token ids recorded as the engine saw them, the prompt the chat template's rendering
with the tools), and the Agents SDK agent and Claude Code run by the controller, trained on."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from examples.harness import prepare as harness
from examples.harness.capture import Script, scripted_engine
from examples.harness.harnesses import CLAUDE_MOUNT, INSTRUCTIONS
from examples.harness.task import CODES, NOTES, make_tasks, notes_text, prompt, score
from rollover.config import load_config
from rollover.controller import Controller
from rollover.gateway.client import GatewayClient
from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread
from rollover.store.models import RolloutCreate, RolloutState
from rollover.training.data import write_tasks
from tests.conftest import ADMIN_KEY
from tests.controller.conftest import make_config, wait_for_rollout
from tests.runs import train_briefly

ROOT = Path(__file__).resolve().parents[2]
CLAUDE_CONFIG = ROOT / "examples" / "harness" / "config_claude.yaml"
AGENTS_SDK_CONFIG = ROOT / "examples" / "harness" / "config_agents_sdk.yaml"
READ_FILE = {
    "name": "read_file",
    "description": "Read a text file of the working folder and return its contents.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}


def test_score_and_tasks():
    [task] = make_tasks(1, seed=0)
    assert score(f"The secret code is {task['code']}.", task["code"]) == 1.0
    other = next(code for code in CODES if code != task["code"])
    assert score(f"{task['code']} or maybe {other}", task["code"]) == 0.0  # the last code word counts
    assert score(f"The code is {task['code'].upper()}!", task["code"]) == 1.0
    assert score(f"The code is {task['code']}s", task["code"]) == 0.0  # a whole word only
    assert score(f"room {task['room']}", task["code"]) == 0.0
    assert f"The secret code is {task['code']}." in notes_text(task)
    for path in (CLAUDE_CONFIG, AGENTS_SDK_CONFIG):
        config = load_config(path)
        assert config.agentlightning.async_rollout.enabled and config.gateway.hold_while_paused
        assert config.agentlightning.local.agent_class.startswith("examples.harness.agent.")


# -- the harnesses against the gateway and a scripted engine (no vLLM) ----------------------


@pytest.fixture(scope="module")
def claude_capture() -> list[dict[str, Any]]:
    """What the model build captures of Claude Code (run outside the sandbox)."""
    return harness.capture_claude_code()


@pytest.fixture(scope="module")
def agents_sdk_capture() -> list[dict[str, Any]]:
    return harness.capture_agents_sdk()


def test_claude_code_runs_unchanged_through_the_gateway(claude_capture):
    """Claude Code 2.1.332 in print mode finds the gateway through ANTHROPIC_BASE_URL alone; its
    streamed calls arrive at the engine as chat requests with its 12 tools and its system
    prompt, and the Read call the engine answers runs and comes back as a tool result."""
    first, second = claude_capture
    assert len(first["tools"]) >= 10 and "Read" in {t["function"]["name"] for t in first["tools"]}
    assert first["stream"] is True and first["messages"][0]["role"] == "system"
    assert [m["role"] for m in second["messages"][-2:]] == ["assistant", "tool"]
    [call] = second["messages"][-2]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"file_path": str(CLAUDE_MOUNT / "notes.txt")}
    assert "The secret code is walrus." in second["messages"][-1]["content"]  # Read ran on the task's notes
    assert second["messages"][:-2] == first["messages"]  # the second turn extends the first


def test_the_agents_sdk_runs_unchanged_through_the_gateway(agents_sdk_capture):
    """The Agents SDK's default model calls the Responses API at OPENAI_BASE_URL; the function
    tool's call and output come back to the engine as chat turns."""
    first, second = agents_sdk_capture
    assert [t["function"]["name"] for t in first["tools"]] == ["read_file"]
    assert first["messages"] == [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": prompt("notes.txt")},
    ]
    assert second["messages"][-1] == {
        "role": "tool",
        "tool_call_id": second["messages"][-2]["tool_calls"][0]["id"],
        "content": notes_text(harness.CAPTURE_TASK),
    }


async def _run_in_the_sandbox(agent_class: str, script: Script, task: dict[str, Any], log_dir: Path) -> list[float]:
    """One rollout of `agent_class` on `task`, run by the controller in the agent sandbox (the
    default) against the gateway and `script`'s engine; the rollout's rewards."""
    with scripted_engine(script) as engine, GatewayThread(store=":memory:", admin_key=ADMIN_KEY) as gateway:
        async with GatewayClient(gateway.url, ADMIN_KEY) as client:
            await client.register_models([{"model": "policy", "endpoint": engine}])
            config = make_config(local={"agent_class": agent_class})
            assert config.local.sandbox
            async with Controller(config, client, log_dir=log_dir, poll_interval=0.1):
                [rollout] = await client.enqueue([RolloutCreate(input=task)])
                done = await wait_for_rollout(client, rollout.rollout_id, timeout=240)
            logs = "".join(p.read_text(errors="replace")[-3000:] for p in log_dir.rglob("*") if p.is_file())
            assert done.state == RolloutState.SUCCEEDED, (done.status, logs)
            return [e.data["value"] for e in await client.events(rollout.rollout_id, event_type="reward")]


@pytest.mark.parametrize(
    ("capture", "agent_class", "tool", "arguments"),
    [
        ("claude_capture", "examples.harness.agent.ClaudeCodeAgent", "Read", {"file_path": str(CLAUDE_MOUNT / NOTES)}),
        ("agents_sdk_capture", "examples.harness.agent.AgentsSdkAgent", "read_file", {"path": NOTES}),
    ],
    ids=["claude_code", "agents_sdk"],
)
def test_in_the_sandbox_the_harnesses_send_the_prompts_the_model_learnt(
    request, tmp_path, capture: str, agent_class: str, tool: str, arguments: dict[str, str]
) -> None:
    """Run by the controller in bubblewrap's sandbox (its private /tmp, the bridge to the
    gateway, the allowlisted environment), each harness reads the task's file, earns reward 1
    from the scripted engine's answer, and sends the engine exactly the prompts the model build
    captures outside the sandbox: what the warm-up teaches is what sandboxed agents send (for
    Claude Code, its folder at the one fixed path through `unshare` inside the sandbox)."""
    captured = request.getfixturevalue(capture)
    script = Script(tool, arguments, harness.answer(harness.CAPTURE_TASK))
    rewards = asyncio.run(_run_in_the_sandbox(agent_class, script, harness.CAPTURE_TASK, tmp_path / "logs"))
    assert rewards == [1.0]
    assert len(script.requests) == len(captured) == 2
    for sent, learnt in zip(script.requests, captured):
        assert sent["messages"] == learnt["messages"] and sent["tools"] == learnt["tools"]
    assert "The secret code is walrus." in script.requests[1]["messages"][-1]["content"]  # the tool read the file


def test_transcripts_swap_the_task_and_keep_the_harness_text(agents_sdk_capture):
    requests = agents_sdk_capture
    chats = harness.transcripts(requests, 40, seed=3)
    tasks = make_tasks(40, seed=3)
    hedged = 0
    for chat, task in zip(chats, tasks):
        # The task's values stand where the capture's stood, and nowhere else.
        asked = json.dumps(chat["messages"][:-1])
        assert [asked.count(code) for code in CODES] == [code == task["code"] for code in CODES]
        assert asked.count(task["topic"]) == 1 and notes_text(task) in chat["messages"][-2]["content"]
        final = chat["messages"][-1]["content"]
        hedged += final == harness.hedge(task)
        assert final in (harness.hedge(task), harness.answer(task))
        assert chat["messages"][:2] == requests[-1]["messages"][:2] and chat["tools"] == requests[-1]["tools"]
    assert 10 <= hedged <= 30


def test_the_copy_drill_puts_the_code_anywhere():
    """The drill's code line sits at varied places among decoys, so only copying the code word
    by what it is passes; each chat asks once and answers with its own code."""
    chats = harness.copy_drill(200, seed=5)
    places = set()
    for chat, task in zip(chats, make_tasks(200, seed=5)):
        ask, reply = chat["messages"]
        lines = ask["content"].splitlines()
        assert (
            reply == {"role": "assistant", "content": harness.answer(task)}
            and lines[-1] == "Reply with the secret code."
        )
        assert [sum(code in line for line in lines) for code in CODES] == [code == task["code"] for code in CODES]
        places.add(lines.index(f"The secret code is {task['code']}."))
    assert len(places) >= 6


# -- against the real engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def harness_model(tmp_path_factory) -> Path:
    """The harness example's model, built once (ROLLOVER_TEST_HARNESS_MODEL names a built one)."""
    if os.environ.get("ROLLOVER_TEST_HARNESS_MODEL"):
        return Path(os.environ["ROLLOVER_TEST_HARNESS_MODEL"])
    # Fewer warm-up steps than the example: what these tests check is the wire, not the policy.
    folder = tmp_path_factory.mktemp("harness-model")
    return harness.harness_model(folder / "tiny-harness-warm40", steps=40, drill_steps=40, cycles=1)


@pytest.fixture(scope="module")
def harness_engine(harness_model, tmp_path_factory):
    from rollover.testing.engine import start_test_engine

    engine = start_test_engine(
        harness_model,
        log_path=tmp_path_factory.mktemp("harness-vllm") / "vllm.log",
        max_model_len=16384,
        extra_args=["--enable-prefix-caching"],  # every Claude Code call shares its ~12k-token prompt
    )
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def attempt(harness_engine):
    """A running rollout behind a real gateway in front of the engine: (gateway, admin, rollout id)."""
    with GatewayThread(store=":memory:", admin_key=ADMIN_KEY) as gateway:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=gateway.url, headers=headers, timeout=120) as admin:
            # As the trainer registers it: the engine opens its generation routes to the gateway.
            asyncio.run(harness_engine.register_with_gateway(gateway.url, ADMIN_KEY))
            rid = admin.post("/api/rollouts", json=[{"input": {}, "is_train": True}]).json()[0]["rollout_id"]
            admin.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running", "last_attempt_id": "a1"}})
            yield gateway, admin, rid


def _records(admin: httpx.Client, rid: str) -> list[dict[str, Any]]:
    events = admin.get(f"/api/rollouts/{rid}/events", params={"event_type": "model_request"}).json()
    return [e["data"] for e in events]


def _check_tokens(record: dict[str, Any], tokenizer: Any) -> None:
    """The recorded prompt is the chat template's rendering of the chat request with its tools,
    and the response ids are the engine's, with one logprob each."""
    request = record["request"]
    messages = json.loads(json.dumps(request["messages"]))
    for message in messages:  # vLLM hands the template each call's arguments as an object
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    rendered = tokenizer.apply_chat_template(
        messages, tools=request.get("tools"), tokenize=False, add_generation_prompt=True
    )
    assert record["prompt_token_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert request.get("tools") and "<tools>" in rendered
    assert record["response_token_ids"] and len(record["response_logprobs"]) == len(record["response_token_ids"])


@pytest.mark.vllm
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_anthropic_sdk_against_the_engine(attempt, harness_model, stream: bool) -> None:
    """The SDK's calls, whole or streamed, reach the engine as its chat template renders them,
    with the tools, and come back in Anthropic's shape; a turn that holds a tool call and its
    result is rendered as the chat API's. (Tool calls the model writes are translated in
    tests/gateway/test_anthropic.py: this tiny model seldom writes a well-formed one.)"""
    gateway, admin, rid = attempt
    client = anthropic.Anthropic(
        base_url=f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/train/anthropic",
        api_key=scoped_key(ADMIN_KEY, rid, "a1"),
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt("notes.txt")}]
    ask: dict[str, Any] = dict(model="policy", max_tokens=48, system=INSTRUCTIONS, tools=[READ_FILE])
    if stream:
        with client.messages.stream(messages=messages, **ask) as events:  # type: ignore[arg-type]
            kinds = [event.type for event in events]
            first = events.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    else:
        first = client.messages.create(messages=messages, **ask)  # type: ignore[arg-type]
    assert first.stop_reason in ("end_turn", "max_tokens", "tool_use")
    [task] = make_tasks(1, seed=5)
    call = {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "notes.txt"}}
    messages += [
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": notes_text(task)}]},
    ]
    second = client.messages.create(messages=messages, **ask)  # type: ignore[arg-type]
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    tokenizer = AutoTokenizer.from_pretrained(harness_model)
    records = _records(admin, rid)
    assert [r["api"]["id"] for r in records] == [first.id, second.id]
    for record in records:
        _check_tokens(record, tokenizer)
    # The second prompt holds the call as the chat API's tool call, and the tool's result.
    [rendered_call] = records[1]["request"]["messages"][-2]["tool_calls"]
    assert rendered_call["id"] == "toolu_01" and rendered_call["function"]["name"] == "read_file"
    assert json.loads(rendered_call["function"]["arguments"]) == {"path": "notes.txt"}
    assert records[1]["request"]["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "toolu_01",
        "content": notes_text(task),
    }
    assert second.usage.input_tokens == len(records[1]["prompt_token_ids"])


@pytest.mark.vllm
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_responses_against_the_engine(attempt, harness_model, stream: bool) -> None:
    """As the Anthropic test, for the Responses API (the Agents SDK's and Codex's)."""
    gateway, admin, rid = attempt
    client = openai.OpenAI(
        base_url=f"{gateway.url}/proxy/rollout/{rid}/attempt/a1/mode/train/openai/v1",
        api_key=scoped_key(ADMIN_KEY, rid, "a1"),
    )
    tool = {"type": "function", "name": "read_file", "description": READ_FILE["description"]}
    tool["parameters"] = READ_FILE["input_schema"]
    ask: dict[str, Any] = dict(model="policy", instructions=INSTRUCTIONS, tools=[tool], max_output_tokens=48)
    items: list[Any] = [{"role": "user", "content": prompt("notes.txt")}]
    if stream:
        with client.responses.stream(input=items, **ask) as events:  # type: ignore[arg-type]
            kinds = [event.type for event in events]
            first = events.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    else:
        first = client.responses.create(input=items, **ask)  # type: ignore[arg-type]
    assert first.status in ("completed", "incomplete")
    [task] = make_tasks(1, seed=6)
    call = {"type": "function_call", "call_id": "call_01", "name": "read_file", "arguments": '{"path": "notes.txt"}'}
    items += [call, {"type": "function_call_output", "call_id": "call_01", "output": notes_text(task)}]
    second = client.responses.create(input=items, **ask)  # type: ignore[arg-type]
    assert second.status in ("completed", "incomplete")
    tokenizer = AutoTokenizer.from_pretrained(harness_model)
    records = _records(admin, rid)
    assert [r["api"]["name"] for r in records] == ["responses", "responses"]
    for record in records:
        _check_tokens(record, tokenizer)
    [rendered_call] = records[1]["request"]["messages"][-2]["tool_calls"]
    assert rendered_call["id"] == "call_01" and rendered_call["function"]["name"] == "read_file"
    assert records[1]["request"]["messages"][-1]["content"] == notes_text(task)
    assert second.usage is not None and second.usage.input_tokens == len(records[1]["prompt_token_ids"])


def _rollout_records(store: Path) -> dict[str, list[dict[str, Any]]]:
    """The recorded calls of each training rollout (held-out calls carry no logprobs)."""
    import sqlite3

    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        out: dict[str, list[dict[str, Any]]] = {}
        for rollout_id, data in db.execute(
            "SELECT e.rollout_id, e.data FROM events e JOIN rollouts r ON r.rollout_id = e.rollout_id"
            " WHERE e.event_type = 'model_request' AND r.is_train = 1 ORDER BY e.event_id"
        ):
            out.setdefault(rollout_id, []).append(json.loads(data))
        return out
    finally:
        db.close()


def _train(config: Path, tmp_path: Path, model: Path, engine: Any, name: str, steps: int) -> list[dict[str, Any]]:
    """`steps` async updates of one group of 2 rollouts each (window 2 groups), on 8 tasks;
    2 held-out tasks evaluated before and after."""
    write_tasks(tmp_path / "train.jsonl", make_tasks(8, seed=7))
    write_tasks(tmp_path / "val.jsonl", make_tasks(2, seed=9))
    train, _ = train_briefly(
        config,
        tmp_path,
        model,
        name,
        steps,
        f"data.train_files={tmp_path / 'train.jsonl'}",
        f"data.val_files={tmp_path / 'val.jsonl'}",
        "data.train_batch_size=1",
        "actor_rollout_ref.rollout.n=2",
        "agentlightning.async_rollout.async_train_batch_size=2",
        "algorithm.filter_groups.enable=false",
        engine=engine,
    )
    return train


@pytest.mark.vllm
def test_the_agents_sdk_agent_runs_as_a_rollout_and_trains(tmp_path, harness_model, harness_engine):
    [row] = _train(AGENTS_SDK_CONFIG, tmp_path, harness_model, harness_engine, "sdk", 1)
    assert row["rollouts/n_failed"] == 0 and row["rollouts/n_missing_reward"] == 0
    records = _rollout_records(tmp_path / "sdk" / "store.db")
    assert records
    for calls in records.values():
        assert all(c["api"]["name"] == "responses" and c["prompt_token_ids"] and c["response_token_ids"] for c in calls)
        assert [t["function"]["name"] for t in calls[0]["request"]["tools"]] == ["read_file"]


@pytest.mark.vllm
def test_claude_code_completes_rollouts_and_two_updates_train_on_them(tmp_path, harness_model, harness_engine):
    """Claude Code, run by the controller, against Rollover's engine: its ~12k-token calls are
    recorded with the engine's token ids, and two async updates train on them."""
    train = _train(CLAUDE_CONFIG, tmp_path, harness_model, harness_engine, "claude", 2)
    for row in train:
        assert row["rollouts/n_failed"] == 0 and row["rollouts/n_missing_reward"] == 0
        assert row["rollouts/n_samples"] >= 2
        # the config's micro-batch holds the update's samples: the system prompt and tools they
        # share (> 10k of each sample's ~12k tokens) are computed once, not once per sample
        assert row["training/prefix_shared_tokens_fraction"] > 0.4
    records = _rollout_records(tmp_path / "claude" / "store.db")
    assert len(records) >= 4
    for calls in records.values():
        first = calls[0]
        assert first["api"]["name"] == "anthropic" and len(first["request"]["tools"]) >= 10
        assert len(first["prompt_token_ids"]) > 10_000  # Claude Code's system prompt, environment and tools
        assert all(
            c["response_token_ids"] and len(c["response_logprobs"]) == len(c["response_token_ids"]) for c in calls
        )
