"""Train a byte-level BPE tokenizer with ZAYA's special tokens and chat template.

Special tokens (each one token, never split or merged):
    `<|startoftext|>`  BOS: starts every rendered conversation; pretraining may prepend it to documents.
    `<|endoftext|>`    EOS: ends a pretraining document.
    `<|pad|>`          PAD: padding only, never trained on.
    `<|im_start|>`     opens a chat turn, followed by the role and a newline (ChatML).
    `<|im_end|>`       end of turn: closes every chat turn. Generation of an assistant answer stops here, so it
                       belongs in the generation config's `eos_token_id` next to `<|endoftext|>`.

The chat template is ChatML. Assistant content and its `<|im_end|>` sit inside `{% generation %}` markers, so
`apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)` marks exactly the tokens a model is
trained on. An assistant message with `weight: 0` (OpenAI fine-tuning format) is rendered without the markers,
so it is context only.

Tools (`apply_chat_template(..., tools=[...])`, OpenAI's function definitions) are listed in the system turn, one JSON
object per line within `<tools></tools>`. An assistant's tool calls follow its text, each as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (the Hermes/Qwen format, which the server decodes
and parses), inside the generation markers; a tool's result is a `tool` turn within `<tool_response>` tags.

Encoding plain text adds no special tokens: callers that pack documents add BOS/EOS themselves.

With `split_digits`, numbers are split into single digits before BPE (as Llama and DeepSeek do): "9,459.14" is nine
tokens whatever the corpus, so a model can copy a value from its input digit by digit instead of learning one
embedding per chunk BPE happened to merge. It is off by default: on the small vocabularies and models trained here,
the digits took merges from words and fine-tuned disposition accuracy fell (tests/finetune/test_preference.py's
supervised start: 0.83 with split digits, 1.00 without).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
TURN_START_TOKEN = "<|im_start|>"
END_OF_TURN_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TURN_START_TOKEN, END_OF_TURN_TOKEN)

# Byte-level BPE starts from all 256 byte symbols; the merges come on top.
_BYTE_ALPHABET_SIZE = 256

# The tools section of the system turn, after the system message (if any): what the model may call, and how.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call functions to help with the request. Their signatures, one JSON object per line:\n"
)
TOOL_CALL_INSTRUCTIONS = (
    "To call a function, write its name and arguments as JSON within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
)

CHAT_TEMPLATE = (
    # An assistant turn's body: its text, then each tool call. `arguments` may be an object (transformers'
    # convention) or already JSON text (OpenAI's).
    "{% macro assistant_body(message) %}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": ' }}{{ function['name'] | tojson }}{{ ', \"arguments\": ' }}"
    "{{ function['arguments'] if function['arguments'] is string else function['arguments'] | tojson }}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' }}"
    "{% endmacro %}"
    "{{ bos_token }}"
    "{% set tools_in_system = tools and messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if tools_in_system %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    f"{{{{ {TOOLS_PREAMBLE!r} + '<tools>\n' }}}}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    f"{{{{ '</tools>\n\n' + {TOOL_CALL_INSTRUCTIONS!r} + '<|im_end|>\n' }}}}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and tools_in_system %}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% if message.get('weight', 1) == 0 %}"
    "{{ assistant_body(message) }}"
    "{% else %}"
    "{% generation %}{{ assistant_body(message) }}{% endgeneration %}"
    "{% endif %}"
    "{{ '\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    model_max_length: int | None = None,
    show_progress: bool = False,
    split_digits: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts` (streamed: an iterator is consumed once, never materialised).

    `vocab_size` counts the special tokens and the 256 byte symbols; the trainer may stop below it on small corpora.
    `split_digits`: every digit is a token of its own (never merged).
    """
    minimum = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")

    backend = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    digits = pre_tokenizers.Digits(individual_digits=True)
    backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level]) if split_digits else byte_level
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    if backend.get_vocab_size() <= minimum:
        raise ValueError("the training texts are empty: no merges could be learned")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[TURN_START_TOKEN, END_OF_TURN_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length if model_max_length is not None else int(1e30),
    )
    return tokenizer


def end_of_turn_token_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """Id of `<|im_end|>`; raises if the tokenizer was not built by `train_tokenizer` (or lacks the token)."""
    token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise ValueError(f"tokenizer has no end-of-turn token {END_OF_TURN_TOKEN!r}")
    return token_id


def chat_template_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids of the special tokens the chat template writes literally (`<|im_start|>`, `<|im_end|>`): tokens a
    plain-text corpus never holds, so pretraining leaves their embedding rows untrained."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    specials = [token for token in tokenizer.all_special_tokens if token in template]
    ids = tokenizer.convert_tokens_to_ids(specials)
    return sorted(set(ids if isinstance(ids, list) else [ids]))


def decode_text(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int] | torch.Tensor, *, skip_special_tokens: bool = False
) -> str:
    """The text of one sequence of ids (`decode` is typed as returning a text or, for a batch, a list of texts)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    if not isinstance(text, str):
        raise TypeError(f"decoding one sequence gave a {type(text).__name__}")
    return text


def generation_eos_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids a generation config should stop on: end of turn (chat answers) and end of text (raw completions)."""
    return [end_of_turn_token_id(tokenizer), tokenizer.eos_token_id]
