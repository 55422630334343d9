"""Writes configs/data/chat_tiny.jsonl: 800 short conversations for the CPU chat fine-tuning recipe
(configs/sft_tiny.yaml). Four kinds of request with answers a tiny model can learn in minutes:
sums, differences, words spelt backwards and letters counted; some with a system turn, some with
two exchanges. Deterministic: the same file every run.

    python scripts/chat_tiny.py
"""

import json
import random
from pathlib import Path

WORDS = (
    "apple river stone cloud green paper light music table water garden window bread tiger "
    "candle forest silver pocket summer winter orange yellow planet rocket island bridge"
).split()
SYSTEMS = ["You are a helpful assistant.", "Answer in one short sentence.", "You are a careful calculator."]


def exchange(rng: random.Random, largest: int = 49) -> tuple[str, str]:
    kind = rng.randrange(4)
    a, b, word = rng.randrange(1, largest + 1), rng.randrange(1, largest + 1), rng.choice(WORDS)
    if kind == 0:
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", f"{a} - {b} = {a - b}."
    if kind == 2:
        return f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}."
    return f"How many letters are in {word}?", f"{word} has {len(word)} letters."


def conversation(rng: random.Random) -> list[dict]:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    for _ in range(1 + (rng.random() < 0.3)):
        question, answer = exchange(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


if __name__ == "__main__":
    rng = random.Random(0)
    out = Path(__file__).parent.parent / "configs" / "data" / "chat_tiny.jsonl"
    out.write_text("".join(json.dumps({"messages": conversation(rng)}) + "\n" for _ in range(800)))
    print(f"wrote {out}")
