"""What a paraphrase keeps and a different question changes, checked beside the embeddings, which
hardly move when one number, name, negation or noun changes:

- anchors: numbers, negations and names, which must agree as multisets;
- content words (the words left when the function words and the words that only frame a
  request are dropped, a plural `s` trimmed): one side's must contain the other's, so that a
  rephrasing may add words but never replace one ("weeks" for "days", "minimum" for "maximum").

The word lists are written here: stop-word lists of NLP libraries come as data downloads
(nltk) or with a whole pipeline (spaCy), and none has the request-framing words."""

from __future__ import annotations

import re

_WORD = re.compile(r"\d+(?:[.,]\d+)*|[A-Za-z][A-Za-z'’]*")
_NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without", "cannot", "nowhere"}
_NUMBER_WORDS = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
                 "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred",
                 "thousand", "million", "billion", "first", "second", "third", "half", "twice", "double"}
_SENTENCE_END = re.compile(r"[.!?:\n]\s*$")


def anchors(text: str) -> tuple[str, ...]:
    """The anchors of `text` in order: numbers as written (digits) or as words, `not` for every
    negation (n't included), and each capitalized word that does not open a sentence (a name),
    lowercased. In order, because the embeddings do not see order ("Celsius to Fahrenheit")."""
    found = []
    for m in _WORD.finditer(text):
        word = m.group()
        lower = word.lower().replace("’", "'")
        if word[0].isdigit():
            found.append(word.replace(",", ""))
        elif lower in _NUMBER_WORDS:
            found.append(lower)
        elif lower in _NEGATIONS or lower.endswith("n't"):
            found.append("not")
        elif word[0].isupper() and not _opens_sentence(text, m.start()) and lower != "i":
            found.append(lower)
    return tuple(found)


_FUNCTION_WORDS = set("""
a an the and or but if then so of to in on at by for with from into onto about as than that this these those
is are was were be been being am do does did done doing have has had having will would shall should can could
may might must i me my mine you your yours we us our it its they them their he him his she her what which who
whom whose where when why how there here up out over under again very just also some any each every all
please tell show give explain describe let know way ways get using use want need like help s t
""".split())


def content_words(text: str) -> list[str]:
    """The words of `text` in order, less function words and request framing, lowercased, a
    plural `s` trimmed; numbers and negations kept."""
    words = []
    for m in _WORD.finditer(text):
        word = m.group().lower().replace("’", "'")
        if word[0].isdigit():
            words.append(word.replace(",", ""))
            continue
        word = "not" if word.endswith("n't") else word.split("'")[0]
        if word in _FUNCTION_WORDS:
            continue
        words.append(word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word)
    return words


def compatible(anchors_a: tuple[str, ...], words_a: frozenset[str], anchors_b: tuple[str, ...],
               words_b: frozenset[str]) -> bool:
    """Whether two questions may be the same one: the same anchors, and one's content words
    within the other's."""
    return anchors_a == anchors_b and (words_a <= words_b or words_b <= words_a)


def _opens_sentence(text: str, start: int) -> bool:
    before = text[:start]
    return not before.strip() or bool(_SENTENCE_END.search(before)) or before.rstrip().endswith(("\"", "'", "("))
