"""The semantic cache bench's pairs, written for the bench from question families of their own
(none is in the cache's calibration set, pyserve/semantic_cache/calibration_set.py): paraphrases
(two phrasings, the same slots) and tricks that change one number, one name, add a negation, or
add a qualifier that narrows or widens the question ("..., ignoring the subplots", "only",
"including the suburbs"); topic swaps (one noun or verb changed) are reported beside them."""

from __future__ import annotations

from pyserve.semantic_cache.calibration_set import family_pairs

FAMILIES = [
    {"phrasings": ["How long does it take to boil an egg for {n} minutes at altitude?",
                   "At altitude, how long should an egg boil if the recipe says {n} minutes?",
                   "If a recipe says {n} minutes, how long do I boil an egg at high altitude?"],
     "n": ["3", "5", "7", "9", "11", "12"]},
    {"phrasings": ["What is the population of {name}?", "How many people live in {name}?",
                   "Tell me how many inhabitants {name} has.", "What's the number of residents of {name}?"],
     "negate": "How many people do not live in {name}?",
     "qualify": ["How many people live in {name}, counting only the city centre?",
                 "What is the population of {name}, including the suburbs?"],
     "name": ["Lisbon", "Toronto", "Nairobi", "Osaka", "Lima", "Krakow", "Melbourne", "Denver"]},
    {"phrasings": ["Can I {topic} with a {name} account?", "Is it possible to {topic} using a {name} account?",
                   "Does a {name} account let me {topic}?"],
     "negate": "Why can't I {topic} with a {name} account?",
     "topic": ["export my data", "share a folder", "change my username", "recover deleted mail"],
     "name": ["Gmail", "Outlook", "Dropbox", "GitHub", "Slack"]},
    {"phrasings": ["What does a {n}% tip on a ${m} bill come to?", "How much is a {n} percent tip on ${m}?",
                   "Calculate a {n}% tip for a bill of ${m}."],
     "n": ["10", "15", "18", "20", "25"], "m": ["40", "65", "80", "120"]},
    {"phrasings": ["Who directed the film {name}?", "Who was the director of {name}?",
                   "Which director made the movie {name}?", "Tell me who directed {name}."],
     "negate": "Who did not direct the film {name}?",
     "qualify": ["Who directed the film {name}, besides the credited director?"],
     "name": ["Vertigo", "Casablanca", "Alien", "Amadeus", "Chinatown", "Jaws", "Psycho"]},
    {"phrasings": ["How many calories are in {n} grams of {topic}?", "What is the calorie count of {n} g of {topic}?",
                   "Tell me the calories in {n} grams of {topic}."],
     "n": ["50", "100", "150", "200", "250"], "topic": ["rice", "oats", "almonds", "cheddar", "salmon"],
     "qualify": ["How many calories are in {n} grams of {topic}, excluding the fat?"]},
    {"phrasings": ["Is {name} a good language for {topic}?", "Should I use {name} for {topic}?",
                   "Would you recommend {name} for {topic}?"],
     "negate": "Why is {name} not a good language for {topic}?",
     "name": ["Rust", "Go", "Haskell", "Kotlin", "Elixir", "Julia"],
     "topic": ["web servers", "data science", "game development", "embedded systems"]},
    {"phrasings": ["What time is it in {name} when it is {n} pm in London?",
                   "If it's {n} pm in London, what time is it in {name}?",
                   "When it is {n} in the afternoon in London, what is the time in {name}?"],
     "n": ["1", "3", "4", "6", "8"], "name": ["Tokyo", "Chicago", "Dubai", "Sydney", "Mumbai"]},
    {"phrasings": ["How do I get from {name} to the airport by train?", "What's the train route from {name} "
                   "to the airport?", "By rail, how can I travel from {name} to the airport?"],
     "negate": "How do I get from {name} to the airport without a train?",
     "qualify": ["How do I get from {name} to the airport by train, avoiding changes?",
                 "How do I get from {name} to the airport by train or else by bus instead?"],
     "name": ["Paddington", "Shinjuku", "Montparnasse", "Grand Central", "Alexanderplatz"]},
    {"phrasings": ["Summarize the plot of {name} in {n} sentences.", "Give me a {n}-sentence summary of {name}.",
                   "In {n} sentences, what happens in {name}?"],
     "n": ["2", "3", "4", "5"], "name": ["Hamlet", "Moby Dick", "Dracula", "Beloved", "Emma", "Middlemarch"],
     "qualify": ["Summarize the plot of {name} in {n} sentences, ignoring the subplots.",
                 "Summarize only the ending of {name} in {n} sentences."]},
    {"phrasings": ["What is the boiling point of {topic} at {n} atmospheres?",
                   "At {n} atm, at what temperature does {topic} boil?",
                   "Tell me the temperature at which {topic} boils under {n} atmospheres."],
     "n": ["1", "2", "5", "10"], "topic": ["water", "ethanol", "acetone", "methanol"]},
    {"phrasings": ["Does {name} ship to {topic}?", "Can I order from {name} to {topic}?",
                   "Will {name} deliver to {topic}?"],
     "negate": "Why doesn't {name} ship to {topic}?",
     "qualify": ["Does {name} ship to {topic}, except for furniture?", "Does {name} ship only to {topic}?"],
     "name": ["Amazon", "IKEA", "Zara", "Etsy", "Uniqlo"], "topic": ["Iceland", "Chile", "Egypt", "Vietnam"]},
]


def bench_pairs() -> list[dict]:
    """{a, b, same, kind}; the tricks' kinds are number, name and negation (from the slot they
    change), the rest `topic`."""
    out = []
    for fam in FAMILIES:
        for p in family_pairs([fam], seed=11, per_family=40):
            if p["kind"] == "slot":
                p["kind"] = _changed_slot(fam, p)
            out.append(p)
    return out


def _changed_slot(fam: dict, pair: dict) -> str:
    for key, kind in (("n", "number"), ("m", "number"), ("name", "name"), ("topic", "topic")):
        if key in fam and sum(v in pair["a"] for v in fam[key]) and not all(
                (v in pair["a"]) == (v in pair["b"]) for v in fam[key]):
            return kind
    return "topic"
