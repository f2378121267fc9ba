"""Which request fields a proxied call may carry, so that what the engine records is the
behaviour policy's.

In train mode every recorded token trains the policy, weighted by its logprob μ under the
policy that sampled it (PPO ratios, rollout correction). A field that changes the sampling
distribution (penalties, `logit_bias`, `allowed_token_ids`, guided or structured decoding,
`min_tokens`) or replaces sampling (beam search, `best_of`, `echo`) makes the engine's tokens
and logprobs something other than samples of π: the maths would be silently wrong. So in
train mode a call may carry only the fields below; any other (or a forbidden field with a
value that is not its neutral one) is refused with a 400 naming it. `temperature`, `top_p`,
`top_k` and `min_p` are allowed because the proxy overrides them (the mode's temperature, the
full softmax). `n` is capped in both modes (`gateway.max_n`, default
`actor_rollout_ref.rollout.n`): an uncapped `n` could hold the drain past its limit.
Val mode trains nothing: any field passes.
"""

from __future__ import annotations

from typing import Any

# Fields that shape the prompt, the stream, the stopping point or the answer's form, never
# which token is drawn: each token is still a sample of π and its logprob π's.
_COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "stop",
        "stop_token_ids",
        "seed",
        "user",
        "n",
        "temperature",  # overridden by the proxy
        "top_p",  # overridden
        "top_k",  # overridden
        "min_p",  # overridden
        "logprobs",  # forced on
        "prompt_logprobs",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "ignore_eos",  # generation goes on past EOS; each token is still drawn from π
        "add_special_tokens",
        "truncate_prompt_tokens",
        "priority",
        "request_id",
        "cache_salt",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        # OpenAI's own fields, which vLLM reads as sampling fields under these names and
        # otherwise ignores, are checked as the ones below.
    }
)
ALLOWED = {
    "chat/completions": _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "parallel_tool_calls",
        "tool_choice",  # checked: only auto and none leave decoding free
        "response_format",  # checked: only text
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "reasoning_effort",
        "verbosity",
        "modalities",
    },
    "completions": _COMMON | {"prompt", "response_format"},
}
# Fields allowed only at the value that leaves sampling alone (None always passes).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "min_tokens": (0,),
    "best_of": (1,),
    "use_beam_search": (False,),
    "echo": (False,),
    "allowed_token_ids": ([],),
    "bad_words": ([],),
}
_FREE_TOOL_CHOICES = ("auto", "none")


class ForbiddenField(ValueError):
    """A request field the mode does not allow; `field` names it, `reason` says why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


def _neutral(name: str, value: Any) -> bool:
    return value is None or any(value == v and type(value) is type(v) for v in NEUTRAL[name])


def check_request(body: dict[str, Any], endpoint: str, mode: str, max_n: int) -> None:
    """Raise `ForbiddenField` if `body`, a chat/completions or completions request for
    `mode`, carries a field that would make its recorded logprobs other than the sampling
    policy's, or asks for more than `max_n` choices."""
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_n):
        raise ForbiddenField("n", f"n must be an integer from 1 to {max_n} (gateway.max_n), got {n!r:.50}")
    if mode != "train":
        return
    allowed = ALLOWED[endpoint]
    for name, value in body.items():
        if name in allowed:
            continue
        if name in NEUTRAL:
            if _neutral(name, value):
                continue
            raise ForbiddenField(
                name,
                f"{name}={value!r:.80} changes what the engine samples: in train mode the recorded "
                "logprobs must be the policy's own (leave it out, or use mode val)",
            )
        raise ForbiddenField(
            name,
            f"field {name!r:.80} is not allowed in train mode: only fields that keep the recorded "
            "logprobs the policy's own are (see the README's 'Security model')",
        )
    tool_choice = body.get("tool_choice")
    if tool_choice is not None and tool_choice not in _FREE_TOOL_CHOICES:
        raise ForbiddenField(
            "tool_choice",
            "tool_choice other than 'auto' or 'none' makes the engine force its output (guided "
            "decoding): in train mode the recorded logprobs must be the policy's own",
        )
    response_format = body.get("response_format")
    if response_format is not None and not (
        isinstance(response_format, dict) and response_format.get("type") == "text"
    ):
        raise ForbiddenField(
            "response_format",
            "response_format other than {'type': 'text'} makes the engine constrain its output "
            "(structured decoding): in train mode the recorded logprobs must be the policy's own",
        )
