"""vLLM starts with a tool-call parser when the model's template writes <tool_call> blocks."""

from __future__ import annotations

import json

import pytest

from rollover.config import load_config
from rollover.distributed.world import World
from rollover.engine.pool import node_engines
from rollover.engine.settings import EngineSettings
from rollover.engine.tool_calls import resolve_tool_call_parser
from rollover.engine.vllm_engine import VLLMEngine
from rollover.modelzoo.chat_template import chatml_template


def _model(tmp_path, template: str, where: str = "jinja"):
    if where == "jinja":
        (tmp_path / "chat_template.jinja").write_text(template)
    else:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return tmp_path


def test_auto_picks_hermes_for_the_bundled_template(tmp_path):
    model = _model(tmp_path, chatml_template())
    assert resolve_tool_call_parser("auto", model) == "hermes"
    command = VLLMEngine(model).command()
    assert command[command.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in command


def test_auto_is_off_for_a_template_without_tool_calls(tmp_path):
    model = _model(tmp_path, "{{ messages[0]['content'] }}", where="tokenizer_config")
    assert resolve_tool_call_parser("auto", model) is None
    assert "--tool-call-parser" not in VLLMEngine(model).command()
    assert resolve_tool_call_parser("llama3_json", model) == "llama3_json"
    assert resolve_tool_call_parser(None, model) is None


def test_a_parser_in_the_engine_args_wins(tmp_path):
    model = _model(tmp_path, chatml_template())
    config = load_config(
        None,
        [
            "actor_rollout_ref.rollout.engine_kwargs.vllm.tool_call_parser=pythonic",
            "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_auto_tool_choice=true",
            "actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs=8",
            "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_prefix_caching=false",
        ],
    )
    flags = config.actor_rollout_ref.rollout.vllm_flags()
    assert flags == [
        "--enforce-eager",
        "--no-enable-prefix-caching",  # a rollout key's flag: false is vLLM's --no- form
        "--tool-call-parser",
        "pythonic",
        "--enable-auto-tool-choice",
        "--max-num-seqs",
        "8",
    ]
    command = VLLMEngine(model, extra_args=flags).command()
    assert command.count("--tool-call-parser") == 1 and command.count("--enable-auto-tool-choice") == 1


@pytest.mark.parametrize(
    ("overrides", "parser"),
    [
        ([], "hermes"),  # auto, no format: read off the template
        (["actor_rollout_ref.rollout.multi_turn.format=llama3_json"], "llama3_json"),
        (["actor_rollout_ref.rollout.multi_turn.format=hermes"], "hermes"),
        (
            [
                "actor_rollout_ref.rollout.multi_turn.format=llama3_json",
                "actor_rollout_ref.rollout.tool_call_parser=pythonic",
            ],
            "pythonic",  # a parser named outright wins over the format
        ),
        (
            [
                "actor_rollout_ref.rollout.multi_turn.format=llama3_json",
                "actor_rollout_ref.rollout.tool_call_parser=null",
            ],
            None,
        ),
    ],
)
def test_multi_turn_format_picks_the_parser_of_the_runs_engines(tmp_path, overrides, parser):
    model = _model(tmp_path, chatml_template())  # auto alone would pick hermes for it
    config = load_config(None, ["trainer.device=cpu", *overrides])
    [engine] = node_engines(EngineSettings.from_config(config), model, tmp_path, World())
    assert engine.tool_call_parser == parser
    command = engine.command()
    if parser is None:
        assert "--tool-call-parser" not in command and "--enable-auto-tool-choice" not in command
    else:
        assert command[command.index("--tool-call-parser") + 1] == parser and "--enable-auto-tool-choice" in command
