"""Write the 5-shot multiple-choice task benchmarks/bench_lm_eval.py runs (`aioprefill_mc5`):
MMLU's format (a description line, 5 solved examples from a `dev` split, then the question with
its choices lettered A-D, answered by the letter), 100 test questions and 5 dev ones made from a
few templates with a seeded generator, so the files are reproducible.

    python benchmarks/lm_eval/make_mc5.py     # rewrites mc5_dev.jsonl and mc5_test.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]  # fmt: skip
OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("up", "down"),
             ("open", "closed"), ("light", "dark"), ("early", "late"), ("full", "empty"),
             ("young", "old"), ("happy", "sad"), ("strong", "weak"), ("wet", "dry"),
             ("rich", "poor"), ("loud", "quiet"), ("hard", "soft"), ("high", "low")]  # fmt: skip


def _choices(rng: random.Random, right: str, wrong: list[str]) -> tuple[list[str], int]:
    options = [right, *rng.sample(sorted(set(wrong) - {right}), 3)]
    rng.shuffle(options)
    return options, options.index(right)


def question(rng: random.Random) -> dict:
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        text, right = f"What is {a} + {b}?", a + b
        wrong = [right + d for d in (-10, -2, -1, 1, 2, 10)]
        options, answer = _choices(rng, str(right), [str(w) for w in wrong])
    elif kind == 1:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        text, right = f"What is {a} times {b}?", a * b
        wrong = [right + d for d in (-a, -b, a, b, 1, -1)] + [a + b]
        options, answer = _choices(rng, str(right), [str(w) for w in wrong])
    elif kind == 2:
        nums = rng.sample(range(10, 1000), 4)
        text = "Which number is the largest?"
        options, answer = [str(n) for n in nums], nums.index(max(nums))
    elif kind == 3:
        i = rng.randrange(7)
        text = f"Which day comes after {DAYS[i]}?"
        options, answer = _choices(rng, DAYS[(i + 1) % 7], DAYS)
    elif kind == 4:
        i = rng.randrange(12)
        text = f"Which month comes before {MONTHS[i]}?"
        options, answer = _choices(rng, MONTHS[i - 1], MONTHS)
    else:
        word, right = rng.choice(OPPOSITES)[:: rng.choice((1, -1))]
        others = [w for pair in OPPOSITES for w in pair if w != word]
        text = f'Which word means the opposite of "{word}"?'
        options, answer = _choices(rng, right, others)
    return {"question": text, "choices": options, "answer": answer}


def main() -> None:
    rng = random.Random(5)
    docs = [question(rng) for _ in range(105)]
    for name, rows in (("mc5_dev.jsonl", docs[:5]), ("mc5_test.jsonl", docs[5:])):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {HERE / name}: {len(rows)} questions")


if __name__ == "__main__":
    main()
