"""The smith example: repo and bug synthesis, the sandbox, the tool protocol, the agent end to
end against a scripted policy through a real gateway, and 2 training steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from examples.smith.agent import (
    ProtocolError,
    ToolCall,
    ToolError,
    Workspace,
    newly_passing,
    parse_tool_call,
    respond,
    reward,
)
from examples.smith.demos import demonstration
from examples.smith.sandbox import Limits, TestReport, run_tests
from examples.smith.task import TEMPLATES, apply_fix, check_repo, make_tasks, write_repo
from rollover.config import load_config
from rollover.controller.job_template import JobTemplate, build_job
from rollover.gateway.keys import scoped_key
from rollover.gateway.server import GatewayThread, free_port, wait_healthy
from rollover.training.data import write_tasks
from tests.conftest import ADMIN_KEY
from tests.runs import train_briefly

ROOT = Path(__file__).resolve().parents[2]
SMITH_CONFIG = ROOT / "examples" / "smith" / "config.yaml"


@pytest.fixture(scope="module")
def tasks() -> list[dict[str, Any]]:
    return make_tasks(len(TEMPLATES), seed=0)  # one bug of each template


# -- synthesis ------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_templates_pass_their_tests(template):
    report = check_repo(template.files)
    assert report.all_passed and len(report.passed) >= 5, report.summary()


def test_bugs_break_tests_and_the_reference_fix_repairs_them(tasks):
    assert len(tasks) == len(TEMPLATES)
    assert {t["repo"] for t in tasks} == {t.name for t in TEMPLATES}
    for task in tasks:
        broken = check_repo(task["files"])
        assert sorted(broken.failed) == task["failing_tests"] and task["failing_tests"]
        assert task["mutation"]["kind"] in {
            "flip_comparison",
            "off_by_one",
            "wrong_operator",
            "swapped_arguments",
            "dropped_return",
        }
        fixed = check_repo(apply_fix(task["files"], task["fix"]))
        assert fixed.all_passed, fixed.summary()
        template = next(t for t in TEMPLATES if t.name == task["repo"])
        assert apply_fix(task["files"], task["fix"]) == template.files  # the fix restores the original
        for path in task["test_files"]:
            assert task["files"][path] == template.files[path]  # only the module is mutated


@pytest.mark.slow
def test_synthesis_is_deterministic(tasks):
    assert json.dumps(make_tasks(len(TEMPLATES), seed=0)) == json.dumps(tasks)
    assert [t["fix"] for t in make_tasks(len(TEMPLATES), seed=1)] != [t["fix"] for t in tasks]


# -- the split and the warm-up demonstrations ---------------------------------------------------


@pytest.fixture(scope="module")
def split() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from examples.smith.prepare import split_tasks

    return split_tasks()


def test_heldout_bugs_are_distinct_from_train_bugs(split):
    train, val = split
    assert len(val) >= 100 and len(train) >= 100
    bug = lambda task: json.dumps(task["files"], sort_keys=True)  # noqa: E731
    assert len({bug(t) for t in val}) == len(val)  # distinct bugs
    assert not {bug(t) for t in val} & {bug(t) for t in train}
    assert not {t["id"] for t in val} & {t["id"] for t in train}
    assert {t["repo"] for t in train} == {t["repo"] for t in val} == {t.name for t in TEMPLATES}


def test_warmup_demonstrations_come_from_train_bugs_only(split):
    from examples.smith.agent import first_message
    from examples.smith.prepare import DEMOS_PER_TASK, MARKDOWN_FRACTION, warmup_transcripts

    train, val = split
    demos = warmup_transcripts(train)
    assert len(demos) == DEMOS_PER_TASK * len(train)
    failing = sum(not any(m["content"].startswith("<tool>") for m in d if m["role"] == "assistant") for d in demos)
    assert abs(failing / len(demos) - MARKDOWN_FRACTION) < 0.1
    prompts = {d[1]["content"] for d in demos}
    assert prompts <= {first_message(t) for t in train}


def replay(tmp_path: Path, task: dict[str, Any], demo: list[dict[str, str]]) -> float:
    """Play a demonstration's assistant turns through the agent's own loop (`respond`): each
    result the agent gives must be the one the demonstration shows; the reward of the end state."""
    workspace = Workspace(tmp_path, task)
    for i, message in enumerate(demo):
        if message["role"] != "assistant":
            continue
        answer = respond(workspace, message["content"])
        if answer is None:
            assert i == len(demo) - 1, "the episode ended before the demonstration did"
            break
        assert answer == demo[i + 1]["content"]
    return reward(workspace.grade(), task["failing_tests"])


@pytest.mark.parametrize("protocol_ok", [True, False])
def test_demonstrations_replay_through_the_agent(tmp_path, tasks, protocol_ok):
    """Protocol-correct demonstrations fix every template's bug; failing ones (the same call in a
    ```json block) leave the repo as it was: reward 0, though the code in them is the fix."""
    for task in tasks:
        demo = demonstration(task, protocol_ok)
        folder = tmp_path / task["id"] / str(protocol_ok)
        assert replay(folder, task, demo) == (1.0 if protocol_ok else 0.0)


def test_demonstrations_fit_the_tokenizer_budgets(tmp_path, tasks):
    """With the tokenizer trained on the templates, a demonstration fits the config's context and
    each reply the agent's per-reply token cap."""
    from examples.smith.prepare import tokenizer_corpus
    from rollover.modelzoo.tiny import build_tiny_tokenizer
    from rollover.modelzoo.warmup import tokenize_chat

    tokenizer = build_tiny_tokenizer(tmp_path, vocab_size=2048, corpus=tokenizer_corpus())
    config = load_config(SMITH_CONFIG, [])
    max_tokens = int(os.environ.get("ROLLOVER_SMITH_MAX_TOKENS", "384"))
    for task in tasks:
        for protocol_ok in (True, False):
            demo = demonstration(task, protocol_ok)
            ids, _ = tokenize_chat(tokenizer, demo)
            assert len(ids) <= config.data.max_prompt_length <= config.actor_rollout_ref.rollout.max_model_len
            for message in demo:
                if message["role"] == "assistant":
                    assert len(tokenizer(message["content"])["input_ids"]) < max_tokens


# -- the sandbox --------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_sandbox_kills_an_infinite_loop_and_its_children(tmp_path):
    write_repo(
        tmp_path,
        {
            "test_loop.py": (
                "import subprocess, pathlib\n"
                "def test_loop():\n"
                "    child = subprocess.Popen(['sleep', '300'])\n"
                "    pathlib.Path('child.pid').write_text(str(child.pid))\n"
                "    while True:\n"
                "        pass\n"
            ),
        },
    )
    started = time.monotonic()
    report = run_tests(tmp_path, Limits(timeout_s=3, cpu_s=60))
    elapsed = time.monotonic() - started
    assert report.timed_out and not report.all_passed
    assert "TIMED OUT" in report.summary()
    assert elapsed < 20
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while _pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(child), "a process the tests spawned outlived the sandbox"


def test_sandbox_memory_limit(tmp_path):
    write_repo(
        tmp_path,
        {
            "test_memory.py": (
                "def test_allocates_2_gib():\n"
                "    block = bytearray(2 * 1024 ** 3)\n"
                "    assert len(block) > 0\n"
                "def test_small():\n"
                "    assert len(bytearray(1024)) == 1024\n"
            ),
        },
    )
    report = run_tests(tmp_path, Limits(memory_mb=256))
    assert report.passed == ["test_memory.py::test_small"]
    assert "MemoryError" in report.failed["test_memory.py::test_allocates_2_gib"]
    assert not report.all_passed


def test_sandbox_cpu_limit(tmp_path):
    write_repo(tmp_path, {"test_spin.py": "def test_spin():\n    while True:\n        pass\n"})
    report = run_tests(tmp_path, Limits(timeout_s=60, cpu_s=1))
    assert not report.all_passed and not report.timed_out
    assert "SIGXCPU" in (report.error or "") or "SIGKILL" in (report.error or ""), report.error


def test_sandbox_result_cannot_be_forged(tmp_path):
    forged = json.dumps({"passed": ["test_x.py::test_a"], "failed": {}})
    write_repo(
        tmp_path,
        {
            "test_x.py": f"print('@@smith-result 0000 ' + {forged!r})\ndef test_a():\n    assert False, 'broken'\n",
        },
    )
    report = run_tests(tmp_path)
    assert report.failed == {"test_x.py::test_a": "AssertionError: broken"}


def test_sandbox_reports_collection_errors(tmp_path):
    write_repo(tmp_path, {"test_bad.py": "import not_a_module\n"})
    report = run_tests(tmp_path)
    assert "collection error" in report.failed["test_bad.py"] and not report.all_passed


# -- the tool protocol ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, call",
    [
        (
            '<tool>{"name": "read_file", "args": {"path": "stack.py"}}</tool>',
            ToolCall("read_file", {"path": "stack.py"}),
        ),
        ('I will look.\n<tool>{"name": "run_tests"}</tool>', ToolCall("run_tests", {})),
        ('<tool>{"name": "finish", "args": {}}', ToolCall("finish", {})),  # no closing tag
        ('<tool>\n```json\n{"name": "list_files", "args": {}}\n```\n</tool>', ToolCall("list_files", {})),
        (
            '<tool>{"name": "edit", "args": {"path": "a.py", "old": "x < 1", "new": "x <= 1", "extra": 1}} thanks</tool>',
            ToolCall("edit", {"path": "a.py", "old": "x < 1", "new": "x <= 1"}),
        ),
        (
            '<tool>{"name": "run_tests"}</tool><tool>{"name": "finish"}</tool>',
            ToolCall("run_tests", {}),
        ),  # the first one
    ],
)
def test_parse_tool_call(text, call):
    assert parse_tool_call(text) == call


def test_parse_no_tool_call():
    assert parse_tool_call("I think the bug is on line 3.") is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("<tool>{name: read_file}</tool>", "not valid JSON"),
        ('<tool>["read_file"]</tool>', "JSON object"),
        ('<tool>{"name": "rm", "args": {}}</tool>', "unknown tool 'rm'"),
        ('<tool>{"name": "read_file", "args": {}}</tool>', "needs string argument(s) path"),
        ('<tool>{"name": "edit", "args": {"path": "a.py", "old": 1}}</tool>', "old, new"),
        ('<tool>{"name": "read_file", "args": "a.py"}</tool>', "args must be a JSON object"),
    ],
)
def test_parse_tool_call_errors(text, message):
    with pytest.raises(ProtocolError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_tool_call(text)


def test_workspace_tools(tmp_path, tasks):
    task = tasks[0]
    workspace = Workspace(tmp_path, task)
    module = task["fix"]["path"]
    assert workspace.execute(ToolCall("list_files")) == "\n".join(sorted(task["files"]))
    assert workspace.execute(ToolCall("read_file", {"path": module})) == task["files"][module]
    with pytest.raises(ToolError, match="outside the repository"):
        workspace.execute(ToolCall("read_file", {"path": "../../etc/passwd"}))
    with pytest.raises(ToolError, match="read-only"):
        workspace.execute(ToolCall("write_file", {"path": task["test_files"][0], "content": "def test_ok(): pass\n"}))
    with pytest.raises(ToolError, match="read-only"):
        workspace.execute(ToolCall("write_file", {"path": "test_mine.py", "content": "def test_ok(): pass\n"}))
    with pytest.raises(ToolError, match="found 0 times"):
        workspace.execute(ToolCall("edit", {"path": module, "old": "no such text", "new": "x"}))
    assert "failed" in workspace.execute(ToolCall("run_tests"))
    assert (
        workspace.execute(ToolCall("edit", {"path": module, "old": task["fix"]["old"], "new": task["fix"]["new"]}))
        == f"edited {module}"
    )
    assert workspace.execute(ToolCall("run_tests")).startswith(
        f"{len(check_repo(task['files']).passed) + len(task['failing_tests'])} passed, 0 failed"
    )


def test_grading_uses_the_original_tests(tmp_path, tasks):
    task = tasks[0]
    workspace = Workspace(tmp_path, task)
    # Tampering behind the tools' back does not help: tests are restored, extra ones removed.
    for path in task["test_files"]:
        (tmp_path / path).write_text("def test_nothing():\n    pass\n")
    (tmp_path / "test_sneaky.py").write_text("def test_nothing():\n    pass\n")
    report = workspace.grade()
    assert sorted(report.failed) == task["failing_tests"]
    assert not (tmp_path / "test_sneaky.py").exists()


def test_reward():
    failing = ["t.py::a", "t.py::b"]
    assert reward(TestReport(passed=["t.py::a", "t.py::b"]), failing) == 1.0
    still = TestReport(passed=["t.py::a"], failed={"t.py::b": "AssertionError"})
    assert reward(still, failing) == 0.0
    assert reward(still, failing, partial_credit=True) == 0.25
    assert reward(TestReport(timed_out=True), failing, partial_credit=True) == 0.0


# -- the agent end to end, driven by a scripted policy ----------------------------------------


def scripted_policy_app(script: list[dict[str, Any]], seen: list[dict[str, Any]]) -> FastAPI:
    """An OpenAI-compatible stand-in whose n-th reply (n = assistant turns so far) is the n-th
    tool call of the script."""
    app = FastAPI()

    @app.get("/healthz")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body)
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        step = script[min(turn, len(script) - 1)]
        content = f"<tool>{json.dumps(step)}</tool>"
        return {
            "id": f"chatcmpl-{turn}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "prompt_token_ids": [1, 2, 3],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                    "token_ids": [4, 5],
                    "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -0.5}]},
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }

    return app


@pytest.fixture
def scripted_policy():
    script: list[dict[str, Any]] = []
    seen: list[dict[str, Any]] = []
    port = free_port("127.0.0.1")
    server = uvicorn.Server(
        uvicorn.Config(scripted_policy_app(script, seen), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_healthy(f"http://127.0.0.1:{port}")
    try:
        yield f"http://127.0.0.1:{port}/v1", script, seen
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def run_smith_agent(task: dict[str, Any], endpoint: str, **env: str) -> tuple[dict, list, str]:
    """The agent, as the controller runs it, on one rollout through a real gateway: the
    rollout's `format=samples` bundle, its `smith_result` events and the agent's stdout."""
    with (
        GatewayThread(store=":memory:", admin_key=ADMIN_KEY) as gateway,
        httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30) as admin,
    ):
        admin.post("/api/models", json=[{"model": "policy", "endpoint": endpoint}]).raise_for_status()
        rollout_id = admin.post("/api/rollouts", json=[{"input": task}]).json()[0]["rollout_id"]
        running = {"status": {"state": "running", "last_attempt_id": "a1"}}
        admin.patch(f"/api/rollouts/{rollout_id}", json=running).raise_for_status()
        env = dict(
            os.environ,
            AGL_OPENAI_BASE_URL=f"{gateway.url}/proxy/rollout/{rollout_id}/attempt/a1/mode/train/openai/v1",
            AGL_EVENT_URL=f"{gateway.url}/api/rollouts/{rollout_id}/attempt/a1/events",
            AGL_KEY=scoped_key(ADMIN_KEY, rollout_id, "a1"),
            AGL_ROLLOUT_ID=rollout_id,
            AGL_ROLLOUT_INPUT=json.dumps(task),
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            **env,
        )
        process = subprocess.run(
            [sys.executable, "-m", "rollover.controller.agent_main", "examples.smith.agent:SmithAgent"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert process.returncode == 0, process.stdout + process.stderr
        bundle = admin.get(f"/api/rollouts/{rollout_id}/events", params={"format": "samples"}).json()
        events = admin.get(f"/api/rollouts/{rollout_id}/events", params={"event_type": "smith_result"}).json()
    return bundle, events, process.stdout


def fixing_script(task: dict[str, Any]) -> list[dict[str, Any]]:
    fix = task["fix"]
    return [
        {"name": "list_files", "args": {}},
        {"name": "read_file", "args": {"path": fix["path"]}},
        {"name": "edit", "args": {"path": fix["path"], "old": fix["old"], "new": fix["new"]}},
        {"name": "run_tests", "args": {}},
        {"name": "finish", "args": {}},
    ]


@pytest.mark.slow
def test_agent_fixes_the_bug_with_a_scripted_policy(tasks, scripted_policy):
    endpoint, script, seen = scripted_policy
    task = tasks[1]
    fix = task["fix"]
    script += fixing_script(task)
    bundle, events, stdout = run_smith_agent(task, endpoint)
    assert bundle["reward"] == 1.0
    assert len(bundle["triplets"]) == 5  # every policy call went through the recording proxy
    assert [t["reward"] for t in bundle["triplets"]] == [None] * 5  # the outcome alone, by default
    assert len(seen) == 5
    results = [m["content"] for m in seen[-1]["messages"] if m["role"] == "user"][1:]
    assert task["fix"]["old"] in results[1]  # read_file showed the buggy module
    assert results[2] == f"<result>\nedited {fix['path']}\n</result>"
    assert "0 failed" in results[3]
    assert "tools ['list_files', 'read_file', 'edit', 'run_tests', 'finish']" in stdout
    assert events[-1]["data"]["all_passed"] is True


def test_newly_passing_counts_each_failing_test_once() -> None:
    passed: set[str] = set()
    assert newly_passing(TestReport(passed=["t1", "other"]), ["t1", "t2"], passed) == 0.5
    assert newly_passing(TestReport(passed=["t1"]), ["t1", "t2"], passed) == 0.0  # t1 passed before
    assert newly_passing(TestReport(passed=[]), ["t1", "t2"], passed) == 0.0
    assert newly_passing(TestReport(passed=["t1", "t2"]), ["t1", "t2"], passed) == 0.5  # t1 broke and came back
    assert passed == {"t1", "t2"}


@pytest.mark.slow
def test_the_edit_that_fixes_the_tests_gets_the_turns_reward(tasks, scripted_policy):
    endpoint, script, _ = scripted_policy
    task = tasks[1]
    script += fixing_script(task)
    bundle, _, _ = run_smith_agent(task, endpoint, ROLLOVER_SMITH_TURN_REWARD="0.5")
    # list, read, run and finish change nothing; the edit makes every failing test pass
    assert [t["reward"] for t in bundle["triplets"]] == [None, None, 0.5, None, None]
    assert bundle["reward"] == 1.0


# -- the Kubernetes Job template ------------------------------------------------------------------


def test_k8s_job_template_renders(tasks):
    template = JobTemplate.from_path(
        ROOT / "examples" / "smith" / "k8s_job.yaml.j2", "agentlightning.k8s.job_template_path"
    )
    template.check()
    manifest = template.render(input=tasks[0], job_name="smith-r1-a1", rollout_id="r1", attempt_id="a1")
    job = build_job(
        manifest,
        job_name="smith-r1-a1",
        namespace="agents",
        rollout_id="r1",
        attempt_id="a1",
        env={"AGL_KEY": "k"},
        ttl_seconds=60,
        deadline_seconds=900,
    )
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "rollover.controller.agent_main", "examples.smith.agent:SmithAgent"]
    env = {e["name"]: e.get("value") or e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    # The attempt key comes from the Job's own Secret.
    assert env["SMITH_TASK_ID"] == tasks[0]["id"] and env["AGL_KEY"] == {"name": "smith-r1-a1-key", "key": "AGL_KEY"}
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


# -- 2 training steps through the real system ----------------------------------------------------


@pytest.mark.vllm
def test_smith_training_smoke(tmp_path, calc_model, vllm_engine, tasks):
    """The tiny calc model cannot fix bugs (rewards ~0); the whole loop must run, with every
    agent reporting a reward and the async metrics written."""
    write_tasks(tmp_path / "train.jsonl", tasks[:4])
    write_tasks(tmp_path / "val.jsonl", tasks[4:])
    train_rows, val_rows = train_briefly(
        SMITH_CONFIG,
        tmp_path,
        calc_model,
        "smith-smoke",
        2,
        f"data.train_files={tmp_path / 'train.jsonl'}",
        f"data.val_files={tmp_path / 'val.jsonl'}",
        "data.val_batch_size=2",
        "agentlightning.local.env.ROLLOVER_SMITH_MAX_TOKENS='16'",
        "agentlightning.local.env.ROLLOVER_SMITH_MAX_STEPS='2'",
        "algorithm.filter_groups.enable=false",  # its rewards are all ~0: every group would be filtered
        engine=vllm_engine,
    )
    config = load_config(SMITH_CONFIG, [])
    batch = config.data.train_batch_size * config.actor_rollout_ref.rollout.n
    for row in train_rows:
        assert row["training/async/n_completed_rollouts"] == batch
        assert row["rollouts/n_failed"] == 0 and row["rollouts/n_missing_reward"] == 0
    assert val_rows and all(r["val/n_failed"] == 0 for r in val_rows)
    logs = list((tmp_path / "smith-smoke" / "agent_logs").glob("*.log"))
    assert logs and any("reward" in log.read_text() for log in logs)


# -- learning on the tiny model ------------------------------------------------------------------
