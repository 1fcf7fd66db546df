"""Chat templates and the assistant loss mask, derived from the tokenizer's own template.

No template is hard-coded: the span of assistant turn i is the text that rendering messages[:i+1] adds
to rendering messages[:i] with the generation prompt. It covers the answer and the end-of-turn token
(trailing whitespace after it is left out), so the drafter learns to predict where a turn ends.
"""

from __future__ import annotations


def render(
    tokenizer, messages: list[dict], add_generation_prompt: bool = False, thinking: bool = False
) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat_template")
    return tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=thinking,
    )


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The messages before the first assistant turn: what the target answers when regenerating."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            break
        out.append(m)
    return out


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids a prompt's conversation gives the target to answer (its last answer left out)."""
    text = render(tokenizer, prompt_messages(messages), add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def assistant_spans(
    tokenizer, messages: list[dict], thinking: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return the text and the [start, end) character spans of assistant turns."""
    full = render(tokenizer, messages, thinking=thinking)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True, thinking=thinking) if i else ""
        upto = render(tokenizer, messages[: i + 1], thinking=thinking)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise ValueError(
                f"chat template of {getattr(tokenizer, 'name_or_path', '?')!r} is not prefix-stable at "
                f"message {i}: cannot locate the assistant turn to build its loss mask"
            )
        spans.append((len(before), len(upto.rstrip())))
    return full, spans


def tokenize_conversation(
    tokenizer, messages: list[dict], max_length: int | None = None, thinking: bool = False
) -> tuple[list[int], list[int], bool]:
    """Token ids, loss mask (1 on assistant tokens + end-of-turn) and whether it was truncated."""
    text, spans = assistant_spans(tokenizer, messages, thinking)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in offsets]
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask, truncated
