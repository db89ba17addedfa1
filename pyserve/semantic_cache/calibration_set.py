"""The pairs the cache's threshold is calibrated on (data/calibration.jsonl), written here by rule:
each question family has several phrasings of one question and slots (a topic, a number, a
name). A positive pair is two phrasings with the same slots; a negative changes one slot (a
topic, a number or a name), adds a negation, or swaps a word for its opposite, in the same or
another phrasing. The bench's pairs (bench/semantic_cache_pairs.py) come from other families.

    python -m pyserve.semantic_cache.calibration_set   # rewrites data/calibration.jsonl
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

PATH = Path(__file__).resolve().parent / "data" / "calibration.jsonl"

# phrasings share the slots {topic}, {n}, {name}; `negate` is the phrasings' negated form;
# `opposites` are word swaps that change the answer.
FAMILIES = [
    {"phrasings": ["How do I {topic} in Python?", "What is the way to {topic} in Python?",
                   "In Python, how can I {topic}?", "Show me how to {topic} using Python."],
     "negate": "How do I not {topic} in Python?",
     "topic": ["sort a list", "read a file", "reverse a string", "merge two dictionaries", "parse JSON",
               "remove duplicates from a list", "open a socket", "copy a directory"],
     "opposites": [("sort a list", "shuffle a list"), ("read a file", "write a file"),
                   ("merge two dictionaries", "split two dictionaries")]},
    {"phrasings": ["What is {n} times {m}?", "Compute {n} multiplied by {m}.", "How much is {n} x {m}?",
                   "Multiply {n} by {m}."],
     "n": ["3", "7", "12", "25", "41"], "m": ["4", "9", "11", "16"]},
    {"phrasings": ["Who was {name}?", "Tell me about {name}.", "Give me a short biography of {name}.",
                   "What is {name} known for?"],
     "negate": "What is {name} not known for?",
     "name": ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie", "Isaac Newton", "Nikola Tesla"]},
    {"phrasings": ["Convert {n} degrees Celsius to Fahrenheit.", "What is {n} °C in Fahrenheit?",
                   "How many degrees Fahrenheit is {n} Celsius?"],
     "n": ["0", "15", "37", "100", "-40"],
     "opposites": [("Celsius to Fahrenheit", "Fahrenheit to Celsius")]},
    {"phrasings": ["What is the capital of {name}?", "Which city is the capital of {name}?",
                   "Name the capital city of {name}."],
     "name": ["France", "Japan", "Kenya", "Peru", "Canada", "Norway", "Vietnam"]},
    {"phrasings": ["How do I {topic} on Linux?", "What command will {topic} on Linux?",
                   "On Linux, how do I {topic}?"],
     "negate": "Why can't I {topic} on Linux?",
     "topic": ["list open ports", "find large files", "check disk usage", "kill a process", "add a user",
               "change file permissions"],
     "opposites": [("add a user", "remove a user"), ("find large files", "find small files")]},
    {"phrasings": ["Is it safe to {topic} during pregnancy?", "Can pregnant women {topic}?",
                   "Should I {topic} while pregnant?"],
     "negate": "Is it not safe to {topic} during pregnancy?",
     "topic": ["drink coffee", "eat sushi", "take ibuprofen", "go running", "fly on a plane"]},
    {"phrasings": ["What year did {name} win the World Cup?", "When did {name} win the football World Cup?",
                   "In which year did {name} last win the World Cup?"],
     "name": ["Brazil", "Italy", "Germany", "Argentina", "Spain", "Uruguay"]},
    {"phrasings": ["Write a haiku about {topic}.", "Compose a haiku on the subject of {topic}.",
                   "Can you write me a haiku about {topic}?"],
     "topic": ["autumn leaves", "the ocean", "a cat asleep", "city rain", "winter mornings"]},
    {"phrasings": ["How many {topic} are in a {name}?", "What number of {topic} does a {name} have?",
                   "Count the {topic} in a {name}."],
     "topic": ["days", "hours", "weeks"], "name": ["year", "month", "fortnight"]},
    {"phrasings": ["What is the {topic} price of a {n}-bedroom flat?", "How much does a {n}-bedroom flat cost, "
                   "on {topic} terms?", "Tell me the {topic} price for a {n}-bedroom apartment."],
     "n": ["1", "2", "3", "4"], "topic": ["average", "maximum", "minimum"],
     "opposites": [("maximum", "minimum")]},
    {"phrasings": ["How do I make {topic} without an oven?", "What's a way to cook {topic} with no oven?",
                   "Can I prepare {topic} if I don't have an oven?"],
     "topic": ["bread", "pizza", "a cake", "granola", "roast potatoes", "cookies"],
     "opposites": [("without an oven", "with an oven")]},
    {"phrasings": ["How far is {name} from {place}?", "What is the distance between {name} and {place}?",
                   "How many kilometres separate {name} and {place}?"],
     "name": ["Paris", "Berlin", "Madrid", "Rome", "Vienna"], "place": ["Lyon", "Munich", "Seville", "Milan"]},
    {"phrasings": ["Which is heavier, a {topic} or a {thing}?", "Does a {topic} weigh more than a {thing}?",
                   "Compare the weight of a {topic} and a {thing}."],
     "topic": ["kilogram of feathers", "bowling ball", "watermelon", "laptop"],
     "thing": ["brick", "cat", "bicycle", "textbook"],
     "opposites": [("heavier", "lighter"), ("more", "less")]},
    {"phrasings": ["What is the {n}th prime number?", "Tell me prime number number {n}.",
                   "Which prime comes in position {n}?"],
     "n": ["5", "10", "20", "50", "100", "12"]},
    {"phrasings": ["How should I {topic} before a job interview?", "What's the best way to {topic} ahead of an "
                   "interview?", "Any advice on how to {topic} before interviewing?"],
     "negate": "Why shouldn't I {topic} before a job interview?",
     "topic": ["prepare answers", "research the company", "dress", "practise coding", "calm my nerves"],
     "opposites": [("before a job interview", "after a job interview")]},
    {"phrasings": ["Translate '{topic}' into {name}.", "How do you say '{topic}' in {name}?",
                   "What is '{topic}' in {name}?"],
     "topic": ["good morning", "thank you", "where is the station", "I am hungry"],
     "name": ["Spanish", "German", "Italian", "Portuguese", "Dutch"]},
    {"phrasings": ["Explain how {topic} works.", "How does {topic} work?", "Give me an explanation of {topic}.",
                   "Describe the workings of {topic}."],
     "negate": "Explain why {topic} does not work.",
     "topic": ["a hash table", "public key encryption", "garbage collection", "a transformer model",
               "TCP congestion control", "a bloom filter", "photosynthesis", "compound interest"]},
]

SLOTS = ("topic", "n", "m", "name", "place", "thing")


def _fill(phrasing: str, slots: dict[str, str]) -> str:
    return phrasing.format(**slots)


def _slot_sets(family: dict, rng: random.Random, count: int) -> list[dict[str, str]]:
    keys = [k for k in SLOTS if k in family]
    combos = list(itertools.product(*(family[k] for k in keys)))
    rng.shuffle(combos)
    return [dict(zip(keys, c)) for c in combos[:count]]


def family_pairs(families: list[dict], seed: int, per_family: int) -> list[dict]:
    """{a, b, same, kind} pairs: positives (two phrasings, same slots) and negatives (kind:
    slot, negation, opposite, or qualifier: a phrasing that narrows or widens the question)."""
    rng = random.Random(seed)
    pairs = []
    for fam in families:
        phrasings = fam["phrasings"]
        for slots in _slot_sets(fam, rng, per_family):
            a, b = rng.sample(phrasings, 2)
            pairs.append({"a": _fill(a, slots), "b": _fill(b, slots), "same": True, "kind": "paraphrase"})
            for key in (k for k in SLOTS if k in fam):
                for value in rng.sample([v for v in fam[key] if v != slots[key]], min(3, len(fam[key]) - 1)):
                    pairs.append({"a": _fill(a, slots), "b": _fill(rng.choice(phrasings), dict(slots, **{key: value})),
                                  "same": False, "kind": "slot"})
            if "negate" in fam:
                pairs.append({"a": _fill(a, slots), "b": _fill(fam["negate"], slots), "same": False,
                              "kind": "negation"})
            for q in fam.get("qualify", []):
                pairs.append({"a": _fill(a, slots), "b": _fill(q, slots), "same": False, "kind": "qualifier"})
            for x, y in fam.get("opposites", []):
                text = _fill(a, slots)
                if x in text:
                    pairs.append({"a": text, "b": text.replace(x, y), "same": False, "kind": "opposite"})
    return pairs


def main() -> None:
    pairs = family_pairs(FAMILIES, seed=7, per_family=40)
    PATH.parent.mkdir(parents=True, exist_ok=True)
    PATH.write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    negatives = sum(not p["same"] for p in pairs)
    print(f"wrote {PATH}: {len(pairs) - negatives} positives, {negatives} negatives")


if __name__ == "__main__":
    main()
