import pytest

from flashdraft import chat, toy

CONV = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "List the numbers from 4 to 7."},
    {"role": "assistant", "content": "4, 5, 6, 7."},
]

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _corpus():
    return toy.task_conversations(300, 0)


@pytest.fixture(scope="module")
def qwen_style():
    return toy.build_tokenizer(_corpus(), 512)


@pytest.fixture(scope="module")
def llama_style():
    tok = toy.build_tokenizer(_corpus(), 512)
    tok.add_tokens(
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True
    )
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def _masked_text(tok, ids, mask):
    return tok.decode([t for t, m in zip(ids, mask, strict=True) if m])


def test_mask_covers_assistant_answers_and_end_of_turn(qwen_style):
    ids, mask, truncated = chat.tokenize_conversation(qwen_style, CONV)
    assert not truncated and len(ids) == len(mask) and set(mask) == {0, 1}
    assert _masked_text(qwen_style, ids, mask) == "2 + 3 = 5.<|im_end|>4, 5, 6, 7.<|im_end|>"
    unmasked = qwen_style.decode([t for t, m in zip(ids, mask, strict=True) if not m])
    assert "What is 2 + 3?" in unmasked and "List the numbers" in unmasked and "assistant" in unmasked
    # masked tokens form exactly two runs, each ending on the end-of-turn token
    im_end = qwen_style.convert_tokens_to_ids("<|im_end|>")
    ends = [i for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
    assert [ids[i] for i in ends] == [im_end, im_end]
    assert ids == qwen_style(chat.render(qwen_style, CONV), add_special_tokens=False)["input_ids"]


def test_mask_on_llama3_style_template(llama_style):
    text, spans = chat.assistant_spans(llama_style, CONV)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.")
    assert [text[a:b] for a, b in spans] == ["2 + 3 = 5.<|eot_id|>", "4, 5, 6, 7.<|eot_id|>"]
    ids, mask, _ = chat.tokenize_conversation(llama_style, CONV)
    assert _masked_text(llama_style, ids, mask) == "2 + 3 = 5.<|eot_id|>4, 5, 6, 7.<|eot_id|>"
    header = llama_style.convert_tokens_to_ids("<|start_header_id|>")
    assert all(not m for t, m in zip(ids, mask, strict=True) if t == header)


def test_truncation_and_prompt_messages(qwen_style):
    ids, mask, truncated = chat.tokenize_conversation(qwen_style, CONV, max_length=20)
    assert truncated and len(ids) == len(mask) == 20
    assert chat.prompt_messages(CONV) == CONV[:2]
    prompt = chat.render(qwen_style, chat.prompt_messages(CONV), add_generation_prompt=True)
    assert prompt.endswith("What is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


def test_template_that_is_not_prefix_stable_is_refused(qwen_style):
    tok = toy.build_tokenizer(_corpus(), 512)
    # renders the number of messages first, so a prefix rendering is not a prefix of the full one
    tok.chat_template = "{{ messages | length }}" + toy.CHAT_TEMPLATE
    with pytest.raises(ValueError, match="not prefix-stable"):
        chat.tokenize_conversation(tok, CONV)


# Qwen3's template shape: an empty think block before every past answer and, with thinking off, in the
# generation prompt as well (so the model is told not to think).
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="module")
def qwen3_style():
    tok = toy.build_tokenizer(_corpus(), 512)
    tok.add_tokens(["<think>", "</think>"], special_tokens=True)
    tok.chat_template = QWEN3_TEMPLATE
    return tok


def test_mask_on_qwen3_style_thinking_template(qwen3_style):
    conv = CONV[1:3]
    # thinking off: the empty think block is part of the prompt, the model only learns the answer
    ids, mask, _ = chat.tokenize_conversation(qwen3_style, conv, thinking=False)
    assert _masked_text(qwen3_style, ids, mask) == "2 + 3 = 5.<|im_end|>"
    # thinking on: the model itself writes the (empty) think block, so it is learned too
    ids, mask, _ = chat.tokenize_conversation(qwen3_style, conv, thinking=True)
    assert _masked_text(qwen3_style, ids, mask).replace("\n", "") == "<think></think>2 + 3 = 5.<|im_end|>"
