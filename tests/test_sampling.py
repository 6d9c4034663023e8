"""What generation samples with: the request's fields over the defaults vLLM takes from the checkpoint."""

import json

from transformers import GenerationConfig

from draftflow.generate import GenerationSettings, PromptRoom, client_command, split_errors, with_system_prompt
from draftflow.sampling import gate_temperature, sampling_record, sampling_text, server_defaults

SETTINGS = dict(max_tokens=64, temperature=0.6, concurrency=1, max_retries=0, seed=3, reasoning_end_marker="</think>",
                max_error_fraction=0.1, max_degenerate_fraction=0.25)  # fmt: skip


def test_requests_carry_the_set_sampling_fields_and_template_arguments_and_leave_unset_ones_to_the_server(tmp_path):
    settings = GenerationSettings(**SETTINGS, sampling={"top_p": 0.95, "top_k": 20, "min_p": None},
                                  chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    command = client_command("http://x/v1/chat/completions", tmp_path / "q.jsonl", tmp_path / "a.jsonl", settings)
    sent = json.loads(command[command.index("--sampling-params") + 1])
    assert sent == {"temperature": 0.6, "seed": 3, "top_p": 0.95, "top_k": 20, "chat_template_kwargs": {"enable_thinking": False}}
    plain = client_command("http://x", tmp_path / "q.jsonl", tmp_path / "a.jsonl", GenerationSettings(**SETTINGS))
    assert json.loads(plain[plain.index("--sampling-params") + 1]) == {"temperature": 0.6, "seed": 3}


def test_the_server_defaults_are_the_checkpoints_generation_config_under_the_servers_flags(tmp_path):
    target, other = tmp_path / "target", tmp_path / "other"
    GenerationConfig(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, do_sample=True).save_pretrained(target)
    GenerationConfig(top_p=0.5, do_sample=True).save_pretrained(other)
    defaults = server_defaults(target, ["--dtype", "bfloat16"])
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert server_defaults(target, ["--generation-config", "vllm"]) == {}
    assert server_defaults(target, [f"--generation-config={other}"]) == {"top_p": 0.5}
    overridden = server_defaults(target, ["--override-generation-config", '{"repetition_penalty": 1.2}'])
    assert overridden == defaults | {"repetition_penalty": 1.2}
    assert server_defaults(tmp_path / "none", []) == {}  # no generation_config.json: vLLM's own defaults
    assert server_defaults(target, None) is None  # an endpoint's are its own

    request = GenerationSettings(**SETTINGS, sampling={"top_k": 40}, chat_template_kwargs={"enable_thinking": True}).request()
    record = sampling_record(request, defaults)
    assert record["effective"] == {"temperature": 0.6, "top_p": 0.8, "top_k": 40, "repetition_penalty": 1.05, "seed": 3}
    assert record["request"] == request  # as each answer's metadata.sampling_params records it
    assert sampling_text(record) == ('temperature 0.6, top_p 0.8, top_k 40, repetition_penalty 1.05, seed 3; '
                                     'chat template arguments {"enable_thinking": true}')  # fmt: skip
    assert sampling_text(sampling_record(request, None)).startswith("temperature 0.6, top_k 40, seed 3 (and the endpoint's defaults)")


def test_the_system_prompt_opens_conversations_without_one_of_their_own():
    asked = {"id": "a", "messages": [{"role": "user", "content": "hi"}]}
    own = {"id": "b", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]}
    assert with_system_prompt(asked, "Be kind.")["messages"][0] == {"role": "system", "content": "Be kind."}
    assert with_system_prompt(own, "Be kind.") == own and with_system_prompt(asked, None) == asked


def test_a_first_prompt_leaving_no_answer_token_in_the_context_is_too_long_to_ask_and_refusals_are_told_apart(tmp_path):
    from tests.twins import QWEN3_ADDED, QWEN3_SPECIAL, QWEN3_TEMPLATE, small_tokenizer

    tokenizer = small_tokenizer(QWEN3_SPECIAL, QWEN3_ADDED, QWEN3_TEMPLATE, eos_token="<|im_end|>")
    settings = GenerationSettings(**SETTINGS, chat_template_kwargs={"enable_thinking": False}, system_prompt="Be brief.")
    question = {"id": "k1", "messages": [{"role": "user", "content": "What does zip() do? " * 40},
                                         {"role": "assistant", "content": "x"}, {"role": "user", "content": "more " * 900}]}  # fmt: skip
    first = [{"role": "system", "content": "Be brief."}, question["messages"][0]]
    rendered = tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    tokens = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert rendered.endswith("<think>\n\n</think>\n\n") and tokens < len(rendered.encode()) - 2  # tokenized, not bounded
    # the prompt and one answer token: only the first prompt counts (later ones hold answers not yet given)
    assert PromptRoom(tokenizer, None, tokens + 1, settings).too_long([question]) == set()
    assert PromptRoom(tokenizer, None, tokens, settings).too_long([question]) == {"k1"}
    bare = GenerationSettings(**SETTINGS)  # without the system turn and the think block it fits in less
    assert PromptRoom(tokenizer, None, tokens - 8, bare).too_long([question]) == set()

    refused = {"id": "k2", "metadata": {"error": "InvalidResponseError('HTTP 400 from http://x: {\"message\": \"This "
                                                 "model\\'s maximum context length is 512 tokens. However, your prompt contains 600 input tokens\"')"}}  # fmt: skip
    failed = {"id": "k3", "metadata": {"error": "ClientConnectorError('Cannot connect')"}}
    assert split_errors([refused, failed]) == ([failed], [refused])


def test_the_gate_reads_the_temperature_the_answers_were_sampled_at_unless_told_another():
    assert gate_temperature({"gate_temperature": None}, {"temperature": 0.6}) == 0.6  # a thinking model, sampled as served
    assert gate_temperature({"gate_temperature": None}, {"temperature": 0}) == 0
    assert gate_temperature({"gate_temperature": 0}, {"temperature": 0.6}) == 0
