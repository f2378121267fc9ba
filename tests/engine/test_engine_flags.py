"""The rollout keys that are vLLM flags reach the server's command line, as the node's engines
are built for a run (`node_engines`), verl's engine_kwargs.vllm winning over them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollover.config import load_config
from rollover.distributed.world import World
from rollover.engine.pool import node_engines
from rollover.engine.settings import EngineSettings
from rollover.modelzoo.chat_template import chatml_template

ROLLOUT = "actor_rollout_ref.rollout"


def engine_argv(tmp_path: Path, *overrides: str) -> list[str]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "chat_template.jinja").write_text(chatml_template())
    config = load_config(None, ["trainer.device=cpu", *overrides])
    [engine] = node_engines(EngineSettings.from_config(config), model, tmp_path, World())
    return engine.command()


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, argv
    return argv[argv.index(flag) + 1]


def test_vllm_defaults_are_left_to_vllm(tmp_path):
    argv = engine_argv(tmp_path)
    assert not [a for a in argv if "prefix-caching" in a or "chunked-prefill" in a or "batched-tokens" in a]
    assert argv.count("--enforce-eager") == 1 and "--no-enforce-eager" not in argv  # the key's default: true


def test_the_keys_reach_the_command_line(tmp_path):
    argv = engine_argv(
        tmp_path,
        f"{ROLLOUT}.enable_prefix_caching=false",
        f"{ROLLOUT}.enable_chunked_prefill=true",
        f"{ROLLOUT}.max_num_batched_tokens=4096",
        f"{ROLLOUT}.enforce_eager=false",
    )
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert "--enable-chunked-prefill" in argv and "--no-enable-chunked-prefill" not in argv
    assert flag_value(argv, "--max-num-batched-tokens") == "4096"
    assert "--no-enforce-eager" in argv and "--enforce-eager" not in argv

    argv = engine_argv(tmp_path, f"{ROLLOUT}.enable_prefix_caching=true", f"{ROLLOUT}.enable_chunked_prefill=false")
    assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
    assert "--no-enable-chunked-prefill" in argv and "--enable-chunked-prefill" not in argv


def test_engine_kwargs_win_over_the_keys(tmp_path):
    kwargs = f"{ROLLOUT}.engine_kwargs.vllm"
    argv = engine_argv(
        tmp_path,
        f"{ROLLOUT}.enable_prefix_caching=false",
        f"{ROLLOUT}.enable_chunked_prefill=true",
        f"{ROLLOUT}.max_num_batched_tokens=4096",
        f"{kwargs}.enable_prefix_caching=true",
        f"{kwargs}.enable_chunked_prefill=false",
        f"{kwargs}.max_num_batched_tokens=1024",
        f"{kwargs}.enforce_eager=false",  # over the key's default, true
        f"{kwargs}.max_num_seqs=8",
    )
    assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
    assert "--no-enable-chunked-prefill" in argv and "--enable-chunked-prefill" not in argv
    assert flag_value(argv, "--max-num-batched-tokens") == "1024"
    assert "--no-enforce-eager" in argv and "--enforce-eager" not in argv
    assert flag_value(argv, "--max-num-seqs") == "8"
    # null in engine_kwargs: vLLM's own default, over the key
    argv = engine_argv(tmp_path, f"{ROLLOUT}.max_num_batched_tokens=4096", f"{kwargs}.max_num_batched_tokens=null")
    assert "--max-num-batched-tokens" not in argv


PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = make_arg_parser(FlexibleArgumentParser())
names = ("enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens", "enforce_eager")
parsed = [parser.parse_args(argv) for argv in json.loads(sys.stdin.read())]
print(json.dumps([{name: getattr(args, name) for name in names} for args in parsed]))
"""


@pytest.mark.vllm  # imports vLLM (its argument parser); no server
def test_vllm_reads_the_flags_as_meant(tmp_path):
    """The flag spellings are vLLM 0.32's own: its server's parser reads them back."""
    argvs = [
        engine_argv(
            tmp_path,
            f"{ROLLOUT}.enable_prefix_caching=false",
            f"{ROLLOUT}.enable_chunked_prefill=true",
            f"{ROLLOUT}.max_num_batched_tokens=4096",
            f"{ROLLOUT}.engine_kwargs.vllm.enforce_eager=false",
        ),
        engine_argv(tmp_path, f"{ROLLOUT}.enable_prefix_caching=true", f"{ROLLOUT}.enable_chunked_prefill=false"),
        engine_argv(tmp_path),
    ]
    assert all(argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] for argv in argvs)
    done = subprocess.run(
        [sys.executable, "-c", PARSE],
        input=json.dumps([argv[3:] for argv in argvs]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [
        {
            "enable_prefix_caching": False,
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": 4096,
            "enforce_eager": False,
        },
        {
            "enable_prefix_caching": True,
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": None,
            "enforce_eager": True,
        },
        {  # null keys: vLLM decides (None until its engine args resolve them)
            "enable_prefix_caching": None,
            "enable_chunked_prefill": None,
            "max_num_batched_tokens": None,
            "enforce_eager": True,
        },
    ]
