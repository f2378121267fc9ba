"""The agent-facing APIs the proxy speaks besides OpenAI's Chat Completions, one module per wire
shape: `anthropic` (Anthropic's Messages API, as Claude Code and the Anthropic SDK call it) and
`responses` (OpenAI's Responses API, as the Agents SDK and Codex call it). Each translates a
request into the engine's `chat/completions` (the model's own chat template with the tools, the
engine's own tool-call parser, token ids and logprobs) and the engine's answer back, whole or as
its stream's events; `common` holds what both share. Recording, routing, pause and versions are
the chat route's (`gateway.proxy`), not copied here.
"""
