"""Tools and tool-call history in a chat prompt.

A chat template that knows tools (it reads `tools`, as Qwen2.5's, Llama 3.1's and Hermes' do) gets them
as transformers passes them: `tools=` plus the messages, with each tool call's `arguments` turned from
the OpenAI API's JSON string into the object such templates expect (vLLM does the same).

A template that ignores tools (SmolLM2's, and most small models') would drop them silently, and fails on
an assistant turn whose content is null. For those the messages are rewritten into plain turns in the
Hermes format that `services/proxy/tool_parsers.py` reads back: the tool signatures go into the system
turn, between <tools></tools>, with how to call one; an assistant's calls become `<tool_call>{"name": ...,
"arguments": ...}</tool_call>` blocks in its text; a tool's result becomes a user turn holding a
`<tool_response>` block. The model then sees everything the client sent, in the format it is asked to
answer in.
"""
from __future__ import annotations

import json
from typing import Any

TOOL_SYSTEM_PROMPT = (
    "You can call functions to answer the user. Their signatures, as JSON schemas, are listed between "
    "<tools> and </tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, reply with one JSON object per call, each between <tool_call> and </tool_call>:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n</tool_call>'
)


def template_reads_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def messages_for_tool_template(messages: list[dict]) -> list[dict]:
    """Messages for a template that renders tools itself: tool-call arguments as objects, and the null
    content of an assistant turn that only calls tools as an empty string. Other messages are left as
    they are (a template that refuses them is the request's error)."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            message = dict(message)
            message["tool_calls"] = [_with_parsed_arguments(call) for call in message["tool_calls"]]
            if message.get("content") is None:
                message["content"] = ""
        out.append(message)
    return out


def messages_with_inline_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that ignores tools: tools, calls and results written into the text. Other
    messages are left as they are (a template that refuses them is the request's error)."""
    out = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_tool_call_block(call) for call in message["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append(message)
    if tools:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        prompt = TOOL_SYSTEM_PROMPT.format(tools=listing)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = out[0] | {"content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _with_parsed_arguments(call: dict) -> dict:
    function = dict(call.get("function") or {})
    function["arguments"] = _arguments(function.get("arguments"))
    return dict(call) | {"function": function}


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # the client's own text; rendered as it is
    return arguments


def _tool_call_block(call: dict) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": _arguments(function.get("arguments"))}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"
