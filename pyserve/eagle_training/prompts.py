"""The prompts a target answers to make its head's training data: a file the user gives, or the
built-in mix (requests composed from a fixed list of tasks and topics, and the openings of
functions from the local Python standard library's modules the embedded model family trains on).
Deterministic for a given seed and Python installation.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pyserve.default_model.training import corpus

# Requests composed from tasks and topics written here (none of them is a bench's prompt): the
# head learns the target's way of answering, so the mix wants breadth of form and subject.
TASKS = (
    "Explain {t} to a beginner in a few sentences.",
    "Write a short story about {t}.",
    "List five facts about {t}.",
    "What are the pros and cons of {t}?",
    "Write a haiku about {t}.",
    "Summarize the history of {t} in one paragraph.",
    "Give three tips for someone interested in {t}.",
    "Write an email to a friend about {t}.",
    "Describe {t} as if you were a tour guide.",
    "What questions would a student ask about {t}? Answer two of them.",
    "What is {t}?",
    "How does {t} work?",
    "Why does {t} matter to ordinary people?",
    "Write a short poem about {t}.",
    "Give me a simple analogy for {t}.",
    "What are common misconceptions about {t}?",
    "Write a tweet announcing a new book about {t}.",
    "Plan a one-hour lesson about {t} for high school students.",
    "Write a dialogue between two friends arguing about {t}.",
    "What would happen if {t} disappeared tomorrow?",
    "Describe {t} in exactly three sentences.",
    "Write a product description for a board game about {t}.",
    "What careers involve {t}?",
    "Give a step-by-step guide to learning about {t}.",
    "Write a news headline and a short article about {t}.",
    "Explain {t} to a five-year-old.",
    "What is the most surprising thing about {t}?",
    "Write a persuasive paragraph about why people should care about {t}.",
    "Create a short quiz with three questions about {t}, with answers.",
    "How has {t} changed over the last hundred years?",
    "Write a diary entry of someone who just discovered {t}.",
    "Give me a fun fact about {t} and explain it.",
)
PAIR_TASKS = (
    "Compare {a} and {b}.",
    "What do {a} and {b} have in common?",
    "Write a short story that involves both {a} and {b}.",
    "Which is more important for society, {a} or {b}? Argue both sides.",
)
TOPICS = (
    "volcanoes", "the stock market", "photosynthesis", "chess openings", "the Roman Empire", "coffee",
    "electric cars", "honeybees", "black holes", "the French Revolution", "sourdough bread", "jazz",
    "climate change", "the human heart", "recycling", "the Olympic Games", "machine learning", "tides",
    "the printing press", "gardening", "marathon training", "the moon landing", "vaccines", "origami",
    "public libraries", "rainforests", "the internet", "penguins", "budget travel", "the piano",
    "earthquakes", "the immune system", "ancient Egypt", "solar panels", "octopuses", "the Silk Road",
    "compound interest", "sleep", "the Renaissance", "glaciers", "smartphones", "democracy", "tea ceremonies",
    "the periodic table", "coral reefs", "the Great Wall of China", "bicycles", "meditation", "comets",
    "the human brain", "supply and demand", "Shakespeare", "wind turbines", "dinosaurs", "the Amazon river",
    "cryptography", "yoga", "the Industrial Revolution", "bees and pollination", "3D printing", "opera",
    "the water supply of a city", "migratory birds", "the Cold War", "microbes", "video games",
    "the Pyramids of Giza", "nuclear energy", "friendship", "public speaking", "mushrooms", "the Vikings",
    "electricity", "time zones", "the Mona Lisa", "vegetarian cooking", "submarines", "the Byzantine Empire",
    "credit scores", "wolves", "the theory of evolution", "skyscrapers", "folk music", "inflation",
    "the Arctic", "antibiotics", "trains", "stand-up comedy", "DNA", "the Aztecs", "minimalism", "rivers",
    "satellites", "the Great Depression", "elephants", "handwriting", "renewable energy", "board games",
    "the speed of light", "ancient Greece", "remote work", "bridges", "the human skeleton", "chocolate",
    "wildfires", "the United Nations", "sharks", "photography", "hydrogen fuel", "the Ottoman Empire",
    "learning a second language", "deserts", "podcasts", "magnetism", "the Beatles", "car engines",
    "ballet", "the Internet of Things", "ocean currents", "volunteering", "the Middle Ages", "robots",
    "plate tectonics", "budgeting", "the Hubble telescope", "spices", "owls", "the Wright brothers",
    "open source software", "fermentation", "lighthouses", "the Maya civilization", "running shoes",
    "bamboo", "the stock exchange in Tokyo", "pandemics", "astronauts", "poetry", "the Sahara",
    "quantum computers", "castles", "kindness", "the metric system", "whales", "impressionist painting",
    "batteries", "urban gardens", "the Mongol Empire", "hiking boots", "the placebo effect", "rainbows",
)
CODE_REQUEST = "Complete this Python function:\n```python\n{code}```"


def builtin_prompts(chat: bool, count: int, seed: int) -> list[str]:
    """`count` prompts: half requests (tasks x topics, one in eight over a pair of topics; chat
    only), half function openings (the first lines of a function, up to its docstring's end; as a
    request to complete it in chat)."""
    rng = random.Random(seed)
    requests = [task.format(t=topic) for task in TASKS for topic in TOPICS]
    rng.shuffle(requests)
    pairs = [task.format(a=a, b=b) for task in PAIR_TASKS for a in TOPICS for b in TOPICS if a < b]
    rng.shuffle(pairs)
    mixed = []
    for i, request in enumerate(requests):
        mixed.append(request)
        if i % 7 == 6:
            mixed.append(pairs[i])
    requests = mixed
    train, _ = corpus.source_files()
    openings = [_opening(fn.source) for _, text in train for fn in corpus.functions(text)]
    openings = [o for o in openings if 40 <= len(o) <= 600]
    rng.shuffle(openings)
    if not chat:
        return openings[:count]
    code = [CODE_REQUEST.format(code=o) for o in openings[: count - count // 2]]
    return [p for pair in zip(requests[: count // 2], code) for p in pair] + code[count // 2 :]


def _opening(source: str) -> str:
    """A function's first lines: through its docstring where one follows the signature's first
    line, else that line and the next."""
    lines = source.splitlines(keepends=True)
    if len(lines) > 1:
        quote = next((q for q in ('"""', "'''") if q in lines[1]), None)
        if quote is not None:
            if lines[1].count(quote) >= 2:
                return "".join(lines[:2])
            end = next((k for k in range(2, len(lines)) if quote in lines[k]), None)
            if end is not None:
                return "".join(lines[: end + 1])
    return "".join(lines[:2])


def file_prompts(path: str | Path) -> list[str | list[dict]]:
    """A user's prompts: a .jsonl file of {"messages": [...]} (a conversation to continue) or
    {"prompt": "..."} lines, or a text file of prompts separated by blank lines."""
    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".jsonl"):
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if not isinstance(item, dict) or not ("messages" in item or "prompt" in item):
                raise ValueError(f"--prompts: line {n} of {path} has neither 'messages' nor 'prompt'")
            prompts.append(item["messages"] if "messages" in item else item["prompt"])
        return prompts
    return [p.strip() for p in text.split("\n\n") if p.strip()]
