"""A corpus of at least 200 strings that stress a tokenizer: English, code, CJK, emoji, combining
marks, runs of whitespace and newlines, numbers, and text that spells special tokens."""

from __future__ import annotations

import itertools

HAND_WRITTEN = [
    "",
    " ",
    "  ",
    "\n",
    "\n\n\n",
    "\t",
    " \t \n \r\n ",
    "Hello",
    "Hello, world!",
    " Hello world ",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done it, haven't they? We'd've known.",
    "DON'T SHOUT; it's RUDE.",
    "e-mail: someone@example.com, web: https://example.org/a?b=c&d=e#f",
    "Prices: $3.50, €4,99, £1_000, ¥200 — 50% off!!!",
    "1234567890",
    " 2024-11-22T06:34:05Z",
    "3.14159265358979 2.71828 -0.0001 1e-10 6.022e23",
    "Call +1 (555) 010-9999 ext. 42",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "const f = async (x) => { await g(x?.y ?? 0); };",
    "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;",
    '<html><body><p class="x">Hi &amp; bye</p></body></html>',
    '{"key": [1, 2, {"nested": null}], "ok": true}',
    '#!/usr/bin/env bash\nset -euo pipefail\necho "$HOME"\n',
    "    indented\n        more indented\n\t\ttabbed",
    "trailing spaces   \nand tabs\t\t\n",
    "日本語のテキストです。",
    "中文：你好，世界！这是一个测试。",
    "한국어 문장도 토큰화합니다.",
    "Здравствуйте, как дела?",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "ไทย ภาษา",
    "Emoji: 😀😃😄😁 🎉🎊 👍🏽 👩‍👩‍👧‍👦 🇫🇷 ❤️",
    "🤖",
    "a😀b😀c",
    "e\u0301 a\u0300 o\u0308 n\u0303",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dalgo",
    "ﬁ ﬂ ﬀ ½ ² ³ ⅓ Ⅻ",
    "\u200b zero\u200bwidth \ufeff bom \u00a0nbsp",
    "Tab\tseparated\tvalues\t1\t2",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "text before<|im_end|>text after",
    "<|im_start|><|im_start|><|im_end|>",
    "<|im_start |> not special <| im_end|>",
    "<repo_name>kvserve<file_sep>main.py",
    "<|endoftext|><|endoftext|>hello",
    "a" * 100,
    "ab" * 60,
    " " * 17 + "x",
    "\n" * 9 + "y",
    "!!!???...,,,;;;:::",
    "(((nested [brackets {and} braces])))",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    "x = 10 ** 9 + 7  # modulus",
    "naïve café résumé coöperate",
    "Ω≈ç√∫˜µ≤≥÷",
    "\\n is not a newline, \\t is not a tab",
    "'single' \"double\" `back`",
    "ALL CAPS 123 abc",
]

WORDS = ["the", "model", "cache", "Paris", "naïve", "東京", "🙂", "KV", "don't", "x86_64", "C++", "λ"]
SEPARATORS = [" ", "  ", "\n", "\t", " \n ", "", ", ", "\n\n"]
NUMBERS = ["0", "7", "42", "1000", "65536", "3.5", "-12", "1,234,567", "007"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def corpus() -> list[str]:
    out = list(HAND_WRITTEN)
    for i, (a, sep, b) in enumerate(itertools.product(WORDS, SEPARATORS, WORDS)):
        if i % 7 == 0:
            out.append(f"{a}{sep}{b}")
    for i, (n, sep, w) in enumerate(itertools.product(NUMBERS, SEPARATORS, WORDS)):
        if i % 11 == 0:
            out.append(f"{n}{sep}{w}{sep}{n}")
    for special, word in itertools.product(SPECIALS, WORDS[:6]):
        out.append(f"{word}{special}{word}")
    return list(dict.fromkeys(out))


# Conversations for the chat-template tests: system turns, several turns, text that spells a special
# token, a conversation that ends with the assistant.
CONVERSATIONS = {
    "single-user": [{"role": "user", "content": "What is the capital of France?"}],
    "system-and-turns": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a joke about KV caches 🙂"},
    ],
    "no-system-multi-turn": [
        {"role": "user", "content": "Write code."},
        {"role": "assistant", "content": "def f():\n    return 1\n"},
        {"role": "user", "content": "Now in 日本語?"},
        {"role": "assistant", "content": "はい。"},
        {"role": "user", "content": "Thanks <|im_end|> bye"},
    ],
    "ends-with-assistant": [
        {"role": "system", "content": ""},
        {"role": "user", "content": "  spaced  \n\n"},
        {"role": "assistant", "content": "ok"},
    ],
}
