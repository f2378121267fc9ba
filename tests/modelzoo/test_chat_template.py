"""The bundled models' template: tools and tool calls rendered, nothing else changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollover.modelzoo.chat_template import SMOLLM2_DEFAULT_SYSTEM, chatml_template
from rollover.modelzoo.tiny import build_tiny_tokenizer
from rollover.modelzoo.toolcalls import tool_call_transcripts
from rollover.modelzoo.warmup import tokenize_chat

# SmolLM2-135M-Instruct's own template, as its GGUF ships it (tools are dropped).
SMOLLM2_ORIGINAL = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
    ],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
]
TOOL = {
    "type": "function",
    "function": {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=400)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_without_tools_smollm2_prompts_are_unchanged(tok, chat, generation_prompt):
    def render(template):
        return tok.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=generation_prompt, chat_template=template
        )

    assert render(chatml_template(SMOLLM2_DEFAULT_SYSTEM)) == render(SMOLLM2_ORIGINAL)


def test_tools_and_calls_are_rendered_the_way_the_hermes_parser_reads_them(tok):
    messages = [
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": None,  # what OpenAI clients send with tool calls
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tools=[TOOL], tokenize=False, chat_template=chatml_template())
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and json.dumps(TOOL) in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n5<|im_end|>" in text
    with_system = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, *messages], tools=[TOOL], tokenize=False, chat_template=chatml_template()
    )
    assert with_system.startswith("<|im_start|>system\nS\n\n# Tools")


def test_tool_call_transcripts_teach_the_call(tok, tmp_path: Path):
    tok.chat_template = chatml_template()
    chats = tool_call_transcripts(20, seed=1)
    for chat in chats:
        names = [t["function"]["name"] for t in chat["tools"]]
        call = chat["messages"][1]["tool_calls"][0]["function"]
        assert call["name"] in names and json.loads(call["arguments"])
    ids, mask = tokenize_chat(tok, chats[0]["messages"], tools=chats[0]["tools"])
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert learned.startswith("<tool_call>\n{") and "</tool_call><|im_end|>" in learned
    assert "# Tools" in tok.decode(ids) and "# Tools" not in learned
