"""What a paraphrase keeps and a different question changes, checked beside the embeddings, which
hardly move when one number, name, negation or word changes. Two questions may share an answer
only if their guards admit each other:

- the same anchors: numbers in order, names in order (capitalized words, and identifiers such
  as a.txt, os.path or snake_case), as many negations, and as many scope words of each kind
  (only; except, excluding, ignoring, avoiding; including, both; instead): "..., ignoring blank
  lines" or "keeps only the duplicates" asks another question than the plain one;
- their content words (less function words and request framing) not one word apart: a single
  word replaced by another ("weeks" for "days", "minimum" for "maximum", "uninstall" for
  "install") is the mark of another question, which a rephrasing rarely is;
- no relation reversed: the content words on either side of "to", "from", "into", "than" or
  "versus" swapped ("celsius to fahrenheit", "fahrenheit to celsius").

The word lists are written here: stop-word lists of NLP libraries come as data downloads
(nltk) or with a whole pipeline (spaCy), and none has the request-framing words."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

# An identifier (a.txt, os.path.join, snake_case, src/main.py) is one word, then numbers, then words.
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_-]*(?:[./][A-Za-z0-9_-]+)+|[A-Za-z][A-Za-z0-9]*_[A-Za-z0-9_]+"
_WORD = re.compile(_IDENTIFIER + r"|\d+(?:[.,]\d+)*|[A-Za-z][A-Za-z'’]*")
_IS_IDENTIFIER = re.compile(_IDENTIFIER)
_DIRECTIONS = {"to", "into", "from", "than", "vs", "versus"}
_NEGATIONS = {"not", "no", "never", "none", "nobody", "nothing", "neither", "nor", "without", "cannot", "nowhere"}
_NUMBER_WORDS = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
                 "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred",
                 "thousand", "million", "billion", "first", "second", "third", "half", "twice", "double"}
# Words that narrow, widen or swap what a question is about, by kind: a rephrasing keeps them
# (perhaps as another word of the same kind), another question adds or drops one.
_SCOPES = {
    "only": "only", "solely": "only", "exclusively": "only",
    "except": "except", "excluding": "except", "exclude": "except", "excludes": "except", "ignoring": "except",
    "ignore": "except", "ignores": "except", "avoiding": "except", "avoid": "except", "skipping": "except",
    "skip": "except", "omitting": "except", "omit": "except", "unless": "except", "besides": "except",
    "including": "include", "include": "include", "includes": "include", "both": "include", "plus": "include",
    "instead": "instead", "rather": "instead",
}
_SENTENCE_END = re.compile(r"[.!?:\n]\s*$")
_FUNCTION_WORDS = set("""
a an the and or but if then so of to in on at by for with from into onto about as than that this these those
is are was were be been being am do does did done doing have has had having will would shall should can could
may might must i me my mine you your yours we us our it its they them their he him his she her what which who
whom whose where when why how there here up out over under again very just also some any each every all
please tell show give explain describe let know way ways get using use want need like help s t
""".split())


Anchors = tuple[tuple[str, ...], tuple[str, ...], int, tuple[str, ...]]  # numbers, names, negations, scopes


@dataclass(frozen=True, slots=True)
class Guard:
    anchors: Anchors
    words: Counter[str]  # content words with their counts
    relations: frozenset[tuple[str, str]]  # the content words either side of a direction word

    def admits(self, other: Guard) -> bool:
        if self.anchors != other.anchors or self.one_word_apart(other):
            return False
        return not any((b, a) in other.relations for a, b in self.relations if a != b)

    def one_word_apart(self, other: Guard) -> bool:
        """Whether the content words differ by one word replaced by another."""
        return sum((self.words - other.words).values()) == 1 and sum((other.words - self.words).values()) == 1


def guard_of(text: str) -> Guard:
    return Guard(anchors(text), Counter(content_words(text)), relations(text))


def relations(text: str) -> frozenset[tuple[str, str]]:
    """(the content word before, the content word after) each direction word of `text`."""
    tokens = [m.group().lower() for m in _WORD.finditer(text)]
    found = set()
    for i, token in enumerate(tokens):
        if token not in _DIRECTIONS:
            continue
        before = next((t for t in reversed(tokens[:i]) if t not in _FUNCTION_WORDS), None)
        after = next((t for t in tokens[i + 1:] if t not in _FUNCTION_WORDS), None)
        if before is not None and after is not None:
            found.add((before, after))
    return frozenset(found)


def anchors(text: str) -> Anchors:
    """The anchors of `text`: its numbers in order (digits as written, or number words), its
    names in order (capitalized words that do not open a sentence, lowercased), how many
    negations it has (n't included) and the kinds of its scope words (sorted, with repeats). In
    order within each kind, because the embeddings do not see order ("Celsius to Fahrenheit",
    "5 minus 3"); not across kinds, which a rephrasing interleaves freely ("Hamlet in 5
    sentences", "a 5-sentence summary of Hamlet")."""
    numbers, names, negations, scopes = [], [], 0, []
    for m in _WORD.finditer(text):
        word = m.group()
        lower = word.lower().replace("’", "'")
        if lower in _SCOPES:
            scopes.append(_SCOPES[lower])
        elif word[0].isdigit():
            numbers.append(word.replace(",", ""))
        elif lower in _NUMBER_WORDS:
            numbers.append(lower)
        elif lower in _NEGATIONS or lower.endswith("n't"):
            negations += 1
        elif _IS_IDENTIFIER.fullmatch(word):
            names.append(word)  # as written: a.txt and A.txt are two files
        elif word[0].isupper() and not _opens_sentence(text, m.start()) and lower != "i":
            names.append(lower)
    return tuple(numbers), tuple(names), negations, tuple(sorted(scopes))


def content_words(text: str) -> list[str]:
    """The words of `text` in order, less function words and request framing, lowercased, a
    plural `s` trimmed; numbers and negations kept."""
    words = []
    for m in _WORD.finditer(text):
        word = m.group().lower().replace("’", "'")
        if word[0].isdigit():
            words.append(word.replace(",", ""))
            continue
        if _IS_IDENTIFIER.fullmatch(word):
            words.append(word)
            continue
        word = "not" if word.endswith("n't") else word.split("'")[0]
        if word in _FUNCTION_WORDS:
            continue
        words.append(word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word)
    return words


def _opens_sentence(text: str, start: int) -> bool:
    before = text[:start]
    return not before.strip() or bool(_SENTENCE_END.search(before)) or before.rstrip().endswith(("\"", "'", "("))
