"""Run a repo's tests in a sandboxed subprocess.

The tests run under a tiny built-in runner (plain `test_*` functions in `test_*.py` files,
the subset of pytest the synthesised repos use; no pytest needed inside the sandbox):
`python -I -B` in the repo folder, with a minimal environment, in a new process group that is
SIGKILLed when the wall-time limit passes (and after every run, so nothing it spawned
survives), under `resource.setrlimit` limits on address space, CPU seconds, file size and
core dumps, and tied to its parent's life (PR_SET_PDEATHSIG).

This contains runaway code (infinite loops, memory bombs, huge files); it is not a security
boundary against hostile code: it has the user's file system and network. For that, run the
agent as a Kubernetes Job (`k8s_job.yaml.j2`) with a NetworkPolicy.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rollover.processes import die_with_parent

RESULT_PREFIX = "@@smith-result "

# Reads a nonce from stdin before any repo code runs, so repo code cannot forge the result.
RUNNER = r"""
import importlib.util, json, pathlib, sys, traceback
nonce = sys.stdin.readline().strip()
root = pathlib.Path.cwd()
sys.path.insert(0, str(root))
passed, failed = [], {}
for path in sorted(root.rglob("test_*.py")):
    rel = path.relative_to(root).as_posix()
    try:
        spec = importlib.util.spec_from_file_location("smith_test_" + rel.replace("/", "_")[:-3], path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as exc:
        failed[rel] = "collection error: " + traceback.format_exception_only(type(exc), exc)[-1].strip()
        continue
    for name in sorted(vars(module)):
        test = getattr(module, name)
        if not (name.startswith("test_") and callable(test)):
            continue
        try:
            test()
            passed.append(rel + "::" + name)
        except BaseException as exc:
            failed[rel + "::" + name] = traceback.format_exception_only(type(exc), exc)[-1].strip()[:300]
print("\n@@smith-result " + nonce + " " + json.dumps({"passed": passed, "failed": failed}), flush=True)
"""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 20.0  # wall time of one test run
    memory_mb: int = 512  # address space (RLIMIT_AS)
    cpu_s: int = 20  # CPU seconds (RLIMIT_CPU)
    file_mb: int = 16  # largest file it may write (RLIMIT_FSIZE)


@dataclass
class TestReport:
    __test__ = False  # not a pytest test class

    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False
    error: str | None = None  # the run itself went wrong (crash, limit, no result)
    output: str = ""  # tail of stdout/stderr

    @property
    def all_passed(self) -> bool:
        return bool(self.passed) and not self.failed and not self.timed_out and self.error is None

    def summary(self, max_chars: int = 1500) -> str:
        """What the agent shows the policy."""
        if self.timed_out:
            return "tests TIMED OUT (killed): every test counts as failed"
        if self.error is not None:
            return f"test run failed: {self.error}\n{self.output[-max_chars:]}"
        lines = [f"{len(self.passed)} passed, {len(self.failed)} failed"]
        lines += [f"FAILED {name}: {message}" for name, message in self.failed.items()]
        return "\n".join(lines)[:max_chars]


def _limit(limits: Limits) -> None:
    """`preexec_fn` of the test process (runs in the child, before exec)."""
    die_with_parent()
    memory = limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    size = limits.file_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_tests(repo: str | Path, limits: Limits = Limits()) -> TestReport:
    """Run every `test_*` function of every `test_*.py` under `repo`, sandboxed."""
    nonce = secrets.token_hex(8)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(repo),
        "LANG": "C.UTF-8",
    }
    process = subprocess.Popen(
        # -I: no PYTHON* variables, user site or script folder on sys.path; -B: no stale .pyc
        # (an edit within the same second and of the same size would not invalidate it).
        [sys.executable, "-I", "-B", "-c", RUNNER],
        cwd=str(repo),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, killed as a whole
        preexec_fn=lambda: _limit(limits),
    )
    timed_out = False
    try:
        stdout, _ = process.communicate(input=(nonce + "\n").encode(), timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(process.pid)
        stdout, _ = process.communicate()
    finally:
        _kill_group(process.pid)  # whatever the tests spawned goes too
    text = stdout.decode(errors="replace")
    if timed_out:
        return TestReport(timed_out=True, output=text[-4000:])
    marker = f"{RESULT_PREFIX}{nonce} "
    results = [line[len(marker) :] for line in text.splitlines() if line.startswith(marker)]
    if not results:
        reason = f"exit code {process.returncode}"
        if process.returncode is not None and process.returncode < 0:
            reason = f"killed by {signal.Signals(-process.returncode).name}"
        return TestReport(error=f"no test result ({reason})", output=text[-4000:])
    data = json.loads(results[-1])
    output = text[: text.rfind(marker)]
    return TestReport(passed=data["passed"], failed=data["failed"], output=output[-4000:])
