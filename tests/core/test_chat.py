"""Chat framing (core/chat): one turn, a turn's frame, the system+user frame, the agent's format."""

from __future__ import annotations

from types import SimpleNamespace

from kvnotes.core.chat import ChatFormat, chat_frame, chat_turn, has_template, turn_frame


def test_turn_frame_is_what_chat_turn_puts_around_the_text(tokenizer):
    open_, close = turn_frame(tokenizer, "user")
    assert chat_turn(tokenizer, "user", "hello") == f"{open_}hello{close}"
    assert open_ == "<|im_start|>user\n"  # SmolLM2: no default system turn kept, no BOS added
    opened = turn_frame(tokenizer, "user", generation_prompt=True)[1]
    assert opened.endswith("<|im_start|>assistant\n")


def test_chat_format_concatenates_to_the_rendered_conversation(tokenizer):
    fmt = ChatFormat.from_tokenizer(tokenizer)
    messages = [{"role": "system", "content": "Z"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yes"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    pieces = (fmt.user[0] + "hi" + fmt.user[1] + fmt.assistant[0] + "yes" + fmt.assistant[1])
    assert rendered.endswith(pieces)


def test_base_models_get_plain_text():
    base = SimpleNamespace(chat_template=None)
    assert not has_template(base)
    assert chat_turn(base, "user", "hi") == "hi"
    assert turn_frame(base, "user") == ("", "")
    assert chat_frame(base) == ("", "\n\n", "\nAnswer:")
    assert ChatFormat.from_tokenizer(base) == ChatFormat.plain()
