"""The parts' token cache: kept ids are exactly what encoding each part alone gives (the real
SmolLM2 tokenizer), the bounds hold, threads share it safely, and the planner's layouts are
the same with it as without, a registered skill's part never tokenized."""

from __future__ import annotations

import random
import threading

import pytest

from kvnotes.core.document import encode
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.front.config import FrontConfig
from kvnotes.serving.library.splice import PieceInfo
from kvnotes.serving.planning.chat_render import lay_out_chat, render_chat_parts
from kvnotes.serving.planning.front_plan import catalog_view
from kvnotes.serving.planning.layout import part_ids
from kvnotes.serving.planning.match import SkillCatalog
from kvnotes.serving.planning.part_tokens import PartTokenCache
from kvnotes.serving.planning.request import read_request

EDGES = [
    "", " ", "  ", "\n", "\n\n", "\n\n\n", "\t", " \n \n", "a", " a", "a ", " a ", "\na\n",
    "Hello, world!", "  leading two", "trailing two  ", "tab\tinside", "crlf\r\nline",
    "héllo wörld", "naïve café", "e\u0301 combining", "日本語のテキスト", "中文 混合 English",
    "emoji 👍🏽 and 👨‍👩‍👧", "Ελληνικά", "עברית", "zero\u200bwidth", "nbsp\u00a0here",
    '{"type": "function", "function": {"name": "get"}}', "1234567890 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n", "\\escaped\\ \"quotes\"", "a" * 5000,
]


class Counting:
    """A tokenizer that counts the texts it encodes (attributes pass through)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, []

    def __call__(self, text, **kwargs):
        self.calls.append(text)
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def random_texts(tokenizer, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pieces = EDGES[:-1] + [tokenizer.decode([rng.randrange(len(tokenizer))]) for _ in range(200)]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def test_kept_ids_are_the_fresh_encoding(tokenizer):
    cache = PartTokenCache()
    texts = EDGES + random_texts(tokenizer, 300)
    for text in texts + texts[::-1]:  # second pass: hits
        assert cache.encode(tokenizer, text) == encode(tokenizer, text), repr(text)
    assert cache.misses == len(set(texts)) and cache.hits == 2 * len(texts) - len(set(texts))


def test_a_kept_part_is_a_fresh_list():
    cache = PartTokenCache()
    tok = lambda text, add_special_tokens=False: {"input_ids": [ord(c) for c in text]}  # noqa: E731
    first = cache.encode(tok, "abc")
    first.append(0)
    assert cache.encode(tok, "abc") == [97, 98, 99]


def test_the_bounds_hold_least_recently_used_first():
    tok = lambda text, add_special_tokens=False: {"input_ids": [ord(c) for c in text]}  # noqa: E731
    cache = PartTokenCache(max_chars=10, max_entries=3)
    for text in ("aaa", "bbb", "ccc"):
        cache.encode(tok, text)
    cache.encode(tok, "aaa")  # now the most recent
    cache.encode(tok, "dd")  # 11 characters: "bbb" goes
    assert len(cache) == 3 and cache.chars == 8
    misses = cache.misses
    cache.encode(tok, "aaa"), cache.encode(tok, "ccc"), cache.encode(tok, "dd")
    assert cache.misses == misses
    cache.encode(tok, "e")  # a fourth entry: "aaa" (least recent now) goes
    cache.encode(tok, "aaa")
    assert cache.misses == misses + 2
    assert cache.encode(tok, "x" * 11) == [120] * 11  # longer than the bound: never kept
    assert "x" * 11 not in cache._ids and cache.chars <= 10
    cache.clear()
    assert len(cache) == 0 and cache.chars == 0


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, None])
def test_a_bad_bound_is_refused(bad):
    with pytest.raises(InvalidArgumentError, match="max_chars"):
        PartTokenCache(max_chars=bad)
    with pytest.raises(InvalidArgumentError, match="max_entries"):
        PartTokenCache(max_entries=bad)


def test_threads_share_one_cache(tokenizer):
    import copy

    texts = random_texts(tokenizer, 60, seed=1)
    want = {t: encode(tokenizer, t) for t in texts}
    cache = PartTokenCache(max_chars=sum(map(len, texts)) // 3, max_entries=25)
    wrong: list[str] = []

    def work(seed: int) -> None:
        tok = copy.deepcopy(tokenizer)  # each planning thread has its own copy
        rng = random.Random(seed)
        for _ in range(400):
            text = rng.choice(texts)
            if cache.encode(tok, text) != want[text]:
                wrong.append(text)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    assert cache.hits + cache.misses == 6 * 400 and cache.hits > 0
    assert len(cache) <= 25 and cache.chars <= cache.max_chars
    assert cache.chars == sum(len(t) for t in cache._ids)


def test_part_ids_with_the_cache_and_known_ids(tokenizer):
    parts = ["You are a helpful agent.\n\n", "REFUNDS: within 24 hours.\n\n", "Q: hi?"]
    plain = part_ids(tokenizer, parts)
    counting = Counting(tokenizer)
    cache = PartTokenCache()
    known = [None, tuple(plain[1]), None]
    assert part_ids(counting, parts, cache=cache, known=known) == plain
    assert parts[1] not in counting.calls  # a known part is not tokenized
    counting.calls.clear()
    assert part_ids(counting, parts, cache=cache, known=known) == plain
    assert not set(parts) & set(counting.calls)  # every part kept (only the BOS probe left)
    with pytest.raises(ValueError, match="known"):
        part_ids(tokenizer, parts, known=[None])


def _catalog(tokenizer, texts: list[str]) -> SkillCatalog:
    pieces = [PieceInfo(f"k{i}", f"skill{i}", tuple(encode(tokenizer, t)), 0)
              for i, t in enumerate(texts)]
    return SkillCatalog.of_pieces(tokenizer, pieces)


SKILLS = ["REFUNDS: a ticket is refunded in full within 24 hours of booking.",
          "BAGGAGE: one cabin bag of 8 kg is free; a checked bag costs 30 euros."]


def test_a_completion_text_laid_out_through_the_cache(tokenizer):
    catalog = _catalog(tokenizer, SKILLS)
    find = catalog_view(catalog, None).find
    cache = PartTokenCache()
    counting = Counting(tokenizer)
    context = f"You are the agent of Fjord Air.\n\n{SKILLS[0]}\n\nNotes: none.\n\n{SKILLS[1]}"
    for question in ("\n\nQ: may I bring a guitar?", "\n\nQ: and a cat? 🐈"):
        body = {"model": "m", "prompt": context + question}
        plain = read_request("completion", body, tokenizer, find=find)
        counting.calls.clear()
        cached = read_request("completion", body, counting, find=find, cache=cache)
        assert cached.prompt_ids == plain.prompt_ids and cached.parts == plain.parts
        assert [p.kind for p in cached.parts].count("skill") == 2
        assert not set(SKILLS) & set(counting.calls)  # skills take their registered ids
    # the second question: only its own part was tokenized (and the BOS probe)
    assert [c for c in counting.calls if c != "a"] == ["\n\nQ: and a cat? 🐈"]


def test_a_chat_laid_out_through_the_cache(tokenizer):
    catalog = _catalog(tokenizer, SKILLS)
    find = catalog_view(catalog, None).find
    messages = [{"role": "system", "content": f"Agent of Fjord Air.\n{SKILLS[1]}\n"},
                {"role": "user", "content": [{"type": "text", "text": "a bag?"},
                                             {"type": "text", "text": "and ünïcode"}]}]
    parts = render_chat_parts(tokenizer, messages).parts
    plain = lay_out_chat(tokenizer, parts, find)
    cache = PartTokenCache()
    counting = Counting(tokenizer)
    assert lay_out_chat(counting, parts, find, cache) == plain
    assert SKILLS[1] not in counting.calls
    assert lay_out_chat(counting, parts, find, cache) == plain
    assert cache.hits > 0 and any(p.kind == "skill" for p in plain.parts)


def test_the_front_config_bound():
    assert FrontConfig().part_cache_chars > 0 and FrontConfig(part_cache_chars=0)
    with pytest.raises(InvalidArgumentError, match="part_cache_chars"):
        FrontConfig(part_cache_chars=-1)
