"""The known-answer canaries the tests share, as suite TOML, and the answers a replayed server gives them.

Each canary carries its reference answer (``expect.answer``): the scripted kind answers with it by default,
and `ANSWERS` makes a replayed provider or engine answer the same.
"""

from __future__ import annotations

ADD = """[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
expect = { number = 42, answer = "42" }
"""
CAPITAL = """[[canary]]
id = "capital"
messages = [{ role = "user", content = "What is the capital of France? Answer with one word." }]
expect = { regex = "^paris\\\\.?$", answer = "Paris" }
"""
COLORS = """[[canary]]
id = "colors"
prompt = "The three primary colors of light are red, green and"
decoding = { max_tokens = 5 }
expect = { regex = "^ ?blue", answer = " blue" }
"""
# prompt substring → answer: what a replayed server says to `ADD` and `CAPITAL`
ANSWERS = {"17 + 25": "42", "capital of France": "Paris"}
# Greedy, seeded, with logprobs: the decoding the replayed servers are probed with.
GREEDY = "temperature = 0.0\ntop_p = 1.0\nmax_tokens = 16\nseed = 0\ntop_logprobs = 5\n"


def suite(name: str, defaults: str, *canaries: str) -> str:
    """A suite's TOML: its name, its ``[defaults]`` (TOML lines) and the canaries' tables."""
    return f'[suite]\nname = "{name}"\n[defaults]\n{defaults}' + "".join(canaries)


# The scripted lab's suite: every canary answered right by default.
PLAIN = suite("plain", "max_tokens = 16\n", ADD, CAPITAL, COLORS)
