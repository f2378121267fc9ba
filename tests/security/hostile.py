"""Agents for the security tests (`tests.security.hostile:Agent`), run by the real controller.

`input.role` picks one:

- `victim`: writes a secret to its log, starts a tool (a process with its key in its
  environment), posts `ready`, and waits until the test posts `release` to its rollout, then
  reports a reward of 1;
- `hostile`: tries every way around the gateway that an agent has been seen to take, and posts
  one `attacks` event: for each attack, whether it got through and what it saw.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import httpx

SECRET = "VICTIM-LOG-SECRET"


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {os.environ['AGL_KEY']}"}


def post_event(event_type: str, data: Any) -> None:
    httpx.post(
        os.environ["AGL_EVENT_URL"], json={"event_type": event_type, "data": data}, headers=_headers(), timeout=30
    ).raise_for_status()


class Agent:
    def run(self, input: dict[str, Any]) -> None:
        if input["role"] == "victim":
            self.victim()
        else:
            post_event("attacks", attack_all(input))
            post_event("reward", {"value": 0.0})

    def victim(self) -> None:
        print(f"{SECRET} key={os.environ['AGL_KEY']}", flush=True)
        # A tool it runs, as agents do: a program whose environment holds the agent's key.
        tool = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        post_event("ready", {})
        events_url = os.environ["AGL_EVENT_URL"].rsplit("/attempt/", 1)[0] + "/events"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            events = httpx.get(events_url, params={"event_type": "release"}, headers=_headers(), timeout=30).json()
            if events:
                break
            time.sleep(0.1)
        tool.kill()
        tool.wait()
        post_event("reward", {"value": 1.0})


# -- the attacks: each returns what it got, or raises (blocked) ------------------------------


def read_store(input: dict[str, Any]) -> str:
    with sqlite3.connect(f"file:{input['store']}?mode=ro", uri=True, timeout=2) as db:
        return f"{db.execute('SELECT count(*) FROM sqlite_master').fetchone()[0]} tables"


def write_store(input: dict[str, Any]) -> str:
    db = sqlite3.connect(input["store"], timeout=5)
    try:
        db.execute("CREATE TABLE hostile_probe (x)")
        db.commit()
    finally:
        db.close()
    return "created table hostile_probe"


def read_weights(input: dict[str, Any]) -> str:
    with open(input["weights"], "rb") as handle:
        return f"read {len(handle.read())} bytes"


def write_weights(input: dict[str, Any]) -> str:
    with open(os.path.join(os.path.dirname(input["weights"]), "hostile.bin"), "wb") as handle:
        handle.write(b"x")
    with open(input["weights"], "r+b"):  # opened for writing; the bytes are left alone
        pass
    return "wrote next to the weights and opened them for writing"


def read_checkpoints(input: dict[str, Any]) -> str:
    return f"listed {os.listdir(input['checkpoints'])}"


def read_victim_log(input: dict[str, Any]) -> str:
    for path in glob.glob(os.path.join(input["logs"], "*.log")):
        with open(path) as handle:
            if SECRET in handle.read():
                return f"found the secret in {path}"
    raise PermissionError(f"no log with the secret among {glob.glob(os.path.join(input['logs'], '*'))}")


def read_other_environments(input: dict[str, Any]) -> str:
    mine = os.environ["AGL_KEY"]
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as handle:
                entries = handle.read().split(b"\0")
        except OSError:
            continue
        keys = [e for e in entries if e.startswith(b"AGL_KEY=") and e != f"AGL_KEY={mine}".encode()]
        if keys:
            return f"another agent's key in {path}"
    raise PermissionError("no other agent's environment readable")


def _reads_a_pipe(pid: str) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/fd/0").startswith("pipe:")
    except OSError:
        return False


def fork_server_pipes(input: dict[str, Any]) -> str:
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue
        pid = path.split("/")[2]
        # Agents forked from the server read like it too; the server is the one fed by a pipe.
        if b"rollover.controller.forkserver" in cmdline and _reads_a_pipe(pid):
            # Opened for writing is enough to show the way in; nothing is written.
            with open(f"/proc/{pid}/fd/0", "wb"):
                return f"opened the fork server's stdin (pid {pid})"
    raise PermissionError("no fork server visible")


def _connect(host: str, port: int) -> str:
    with socket.create_connection((host, port), timeout=3):
        return f"connected to {host}:{port}"


def tcp_store(input: dict[str, Any]) -> str:
    errors = []
    for host in ["127.0.0.1", *input["host_addresses"]]:
        try:
            return _connect(host, input["tcp_store_port"])
        except OSError as exc:
            errors.append(f"{host}: {exc}")
    raise ConnectionError("; ".join(errors))


def learned_urls(input: dict[str, Any]) -> list[str]:
    """The engine addresses an agent could learn: given (as if guessed), any URL in what the
    gateway tells it about its own rollout (records, error reasons, served names), and any
    engine socket in the temporary folder."""
    urls = set(input["engines"])
    events_url = os.environ["AGL_EVENT_URL"].rsplit("/attempt/", 1)[0] + "/events"
    try:
        text = httpx.get(events_url, headers=_headers(), timeout=30).text
        text += httpx.get(os.environ["AGL_OPENAI_BASE_URL"] + "/models", headers=_headers(), timeout=30).text
    except httpx.HTTPError:
        text = ""
    for word in text.replace('"', " ").replace("\\", " ").split():
        if word.startswith(("http://", "http+unix://")) and "/proxy/" not in word and "/api/" not in word:
            urls.add(word.rstrip(",.:;)"))
    for folder in ("/tmp", os.environ.get("TMPDIR", "/tmp"), "/run", "/dev/shm"):
        for path in glob.glob(os.path.join(folder, "rollover-engine-*", "*.sock")):
            urls.add("http+unix://" + quote(path, safe="") + "/v1")
    return sorted(urls)


def _engine_client(url: str) -> tuple[httpx.Client, str]:
    """A client to the engine at `url` (TCP or `http+unix://SOCKET/v1`) and its root path."""
    parts = urlsplit(url)
    root = parts.path.removesuffix("/v1").rstrip("/")
    if parts.scheme == "http+unix":
        transport = httpx.HTTPTransport(uds=unquote(parts.netloc))
        return httpx.Client(transport=transport, base_url="http://localhost", timeout=3), root
    return httpx.Client(base_url=f"{parts.scheme}://{parts.netloc}", timeout=3), root


def engines(input: dict[str, Any]) -> str:
    """Every learned address, with every key the agent holds (none, its own, a guess): a dev
    route (pause the engine) and generation. Through if any answers other than 401."""
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 100}}
    refused = []
    for url in learned_urls(input):
        try:
            client, root = _engine_client(url)
            with client:
                for key in (None, os.environ["AGL_KEY"], "EMPTY"):
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    for path, body in (("/pause", {}), ("/v1/chat/completions", chat)):
                        response = client.post(root + path, json=body, params={"mode": "keep"}, headers=headers)
                        if response.status_code != 401:
                            return f"{url}{path} answered {response.status_code} with key {key!r}"
                refused.append(f"{url}: 401 with every key")
        except (httpx.HTTPError, OSError) as exc:
            refused.append(f"{url}: {exc!r}")
    # Engines that answered first: the report is cut short, and a busy machine's temporary
    # folder may hold many dead engines' sockets.
    refused.sort(key=lambda line: not line.endswith("401 with every key"))
    raise ConnectionError("; ".join(refused))


def viewer(input: dict[str, Any]) -> str:
    response = httpx.get(input["viewer"] + "api/rollouts", headers={"Host": "attacker.example"}, timeout=3)
    if response.status_code == 200:
        return "the viewer served every rollout"
    raise PermissionError(f"the viewer answered {response.status_code}")


def forbidden_sampling(input: dict[str, Any]) -> str:
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 100}}
    response = httpx.post(
        os.environ["AGL_OPENAI_BASE_URL"] + "/chat/completions", json=body, headers=_headers(), timeout=30
    )
    if response.status_code == 200:
        return "the engine sampled with logit_bias"
    raise PermissionError(f"{response.status_code}: {response.text[:200]}")


ATTACKS: dict[str, Callable[[dict[str, Any]], str]] = {
    "read_store": read_store,
    "write_store": write_store,
    "read_weights": read_weights,
    "write_weights": write_weights,
    "read_checkpoints": read_checkpoints,
    "read_victim_log": read_victim_log,
    "read_other_environments": read_other_environments,
    "fork_server_pipes": fork_server_pipes,
    "tcp_store": tcp_store,
    "engines": engines,
    "viewer": viewer,
    "forbidden_sampling": forbidden_sampling,
}


def attack_all(input: dict[str, Any]) -> dict[str, dict[str, Any]]:
    results = {}
    for name, attack in ATTACKS.items():
        try:
            results[name] = {"succeeded": True, "detail": attack(input)}
        except Exception as exc:
            results[name] = {"succeeded": False, "detail": f"{type(exc).__name__}: {exc}"[:500]}
    print(json.dumps(results, indent=1), flush=True)
    return results
