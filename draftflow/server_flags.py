"""A vLLM server's flags as they shape what it computes: the part of the answer
store's and the extraction journal's keys that comes from the server.

Apart from ``draftflow.dependencies`` (which lists them with the config keys) so
that the generate and extract_plan jobs' code versions cover only this.
"""

from __future__ import annotations

from draftflow import chat_template

# Server flags that change nothing a request computes; ``--chat-template`` counts by the text it gives.
UNKEYED_SERVER_FLAGS = {
    "--data-parallel-size": "replicas of one model answer alike; it spreads the requests",
    "--max-model-len": "the room for a prompt and its answer: an answer that fits is the same "
    "(one that does not is an error, asked again)",
    "--enforce-eager": "CUDA graphs replay the same kernels",
}


def keyed_server_flags(server_args: list[str]) -> list[str]:
    """The flags as they shape answers: UNKEYED_SERVER_FLAGS out, the ``--chat-template``
    value replaced by the sha256 of the text it gives."""
    keyed, skip = [], False
    for position, arg in enumerate(server_args):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        following = server_args[position + 1] if position + 1 < len(server_args) else "--"
        takes_value = "=" not in arg and not following.startswith("--")
        if name in UNKEYED_SERVER_FLAGS:
            skip = takes_value
        elif name == chat_template.FLAG:
            text = chat_template.flag_text(chat_template.flag_value(server_args))
            keyed.append(f"{name}=sha256:{chat_template.digest(text)}")
            skip = takes_value
        else:
            keyed.append(arg)
    return keyed


def extraction_server_flags(server_args: list[str]) -> list[str]:
    """The flags as they shape hidden states: the chat template aside (the server is
    given token ids)."""
    return [flag for flag in keyed_server_flags(server_args) if not flag.startswith(chat_template.FLAG)]
