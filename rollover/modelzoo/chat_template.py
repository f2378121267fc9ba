"""The ChatML chat template of the bundled models, with function calling.

Agent frameworks send `tools` with their requests and read `tool_calls` back. vLLM's
`hermes` tool-call parser turns `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in
the model's text into `tool_calls`; this template shows the model the tools (in the system
turn, one JSON schema per line inside `<tools>`), renders earlier calls in that same form and
tool results as `tool` turns. Without tools it renders exactly what the models' original
templates render, so a model warmed up before keeps seeing the same prompts.

A vision-language model's template (`image_marker`) writes the marker where a message has an
image part (`image`, as vLLM hands parts to templates, or the APIs' `image_url` and
`input_image`); the model's processor expands its placeholder to the image's tokens.
"""

from __future__ import annotations

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_TOOLS_INTRO = (
    "# Tools\\nYou can call these functions; each is a JSON schema on its own line inside <tools></tools>:\\n<tools>"
)
_TOOLS_OUTRO = (
    "\\n</tools>\\n"
    "To call a function, answer with one JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags:\\n"
    '<tool_call>\\n{\\"name\\": \\"<function name>\\", \\"arguments\\": {<arguments as JSON>}}\\n</tool_call>'
)


def chatml_template(default_system: str | None = None, image_marker: str | None = None) -> str:
    """The Jinja template; `default_system` opens chats that bring no system message
    (SmolLM2's own template does that; the tiny model's does not); `image_marker` is written for
    each image part (a vision-language model's; None: image parts are left out, as before)."""
    default = "" if default_system is None else default_system.replace("'", "\\'")
    image = ""
    if image_marker is not None:
        image = f"{{%- elif part['type'] in ('image', 'image_url', 'input_image') -%}}{{{{- '{image_marker}' -}}}}"
    return (
        "{%- set ns = namespace(tools='') -%}"
        "{%- if tools -%}"
        f"{{%- set ns.tools = '{_TOOLS_INTRO}' -%}}"
        "{%- for tool in tools -%}{%- set ns.tools = ns.tools + '\\n' + (tool | tojson) -%}{%- endfor -%}"
        f"{{%- set ns.tools = ns.tools + '{_TOOLS_OUTRO}' -%}}"
        "{%- endif -%}"
        f"{{%- set default_system = '{default}' -%}}"
        "{%- if (not messages or messages[0]['role'] != 'system') and (default_system or ns.tools) -%}"
        "{{- '<|im_start|>system\\n' + default_system -}}"
        "{%- if default_system and ns.tools -%}{{- '\\n\\n' -}}{%- endif -%}"
        "{{- ns.tools + '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- set content = message['content'] if message['content'] is defined else none -%}"
        "{%- if content is string -%}"
        "{{- content -}}"
        "{%- elif content is iterable and content is not mapping -%}"
        "{%- for part in content -%}"
        "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
        f"{image}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{%- if loop.first and message['role'] == 'system' and ns.tools -%}"
        "{{- '\\n\\n' + ns.tools -}}"
        "{%- endif -%}"
        "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
        "{%- for call in message['tool_calls'] -%}"
        "{%- set fn = call['function'] if call['function'] is defined else call -%}"
        "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
        "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
        "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}"
        "{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
        "{{- '}\\n</tool_call>' -}}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )
