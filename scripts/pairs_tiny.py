"""Writes configs/data/pairs_tiny.jsonl: 1,000 preference pairs for the CPU DPO recipe
(configs/dpo_tiny.yaml), on the requests of chat_tiny.py (sums, differences, words spelt backwards,
letters counted): `chosen` the right answer, `rejected` a wrong one in the same form. Numbers go up
to 5 only: 40 sums and differences, which a 0.92M model learns from pairs (with numbers up to 49
or 9, held-out accuracy did not rise reliably: it memorised the train pairs instead). Most pairs
give the request as a `prompt`; some as `messages` after a system turn, with the replies as
assistant messages. Deterministic: the same file every run.

    python scripts/pairs_tiny.py
"""

import json
import random
import re
from pathlib import Path

from chat_tiny import SYSTEMS, exchange


def wrong(rng: random.Random, answer: str) -> str:
    """The answer made wrong: its last number another, or else its last word spelt wrongly backwards."""
    numbers = list(re.finditer(r"\d+", answer))
    if numbers:
        n = numbers[-1]
        return answer[: n.start()] + str(abs(int(n.group()) + rng.choice([-3, -2, -1, 1, 2, 3]))) + answer[n.end() :]
    head, last = answer[:-1].rsplit(" ", 1)
    swaps = [i for i in range(len(last) - 1) if last[i] != last[i + 1]]
    i = rng.choice(swaps)
    forwards, swapped = last[::-1], last[:i] + last[i + 1] + last[i] + last[i + 2 :]
    return f"{head} {rng.choice([forwards, swapped])}."


def pair(rng: random.Random) -> dict:
    question, answer = exchange(rng, largest=5)
    rejected = wrong(rng, answer)
    while rejected == answer:  # |n - k| can land on n
        rejected = wrong(rng, answer)
    if rng.random() < 0.7:
        return {"prompt": question, "chosen": answer, "rejected": rejected}
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": question}]
    reply = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    return {"messages": messages, "chosen": reply(answer), "rejected": reply(rejected)}


if __name__ == "__main__":
    rng = random.Random(1)  # not chat_tiny's 0: other questions than the fine-tuning's
    out = Path(__file__).parent.parent / "configs" / "data" / "pairs_tiny.jsonl"
    out.write_text("".join(json.dumps(pair(rng)) + "\n" for _ in range(1000)))
    print(f"wrote {out}")
