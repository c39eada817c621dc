"""Regex patterns that may backtrack catastrophically: the heuristic behind `canaryd validate`'s warnings.

A canary's regex check has a time bound (`canaryd.canaries.CHECK_TIMEOUT_S`) that contains such a pattern
whatever this says; this only warns early, naming the pattern.
"""

from __future__ import annotations

import re
import re._parser as sre_parse

_C = sre_parse  # the opcodes of Python's own regex parser (``re._parser``), used only by this heuristic
_REPEATS = (_C.MAX_REPEAT, _C.MIN_REPEAT)
_ONE_CHAR = (_C.LITERAL, _C.NOT_LITERAL, _C.ANY, _C.IN)
_SAMPLE = [chr(i) for i in range(32, 127)] + ["\t", "\n", "\u00a0", "é", "ß", "Ж", "中"]
_CATEGORIES = {
    _C.CATEGORY_DIGIT: str.isdigit,
    _C.CATEGORY_NOT_DIGIT: lambda c: not c.isdigit(),
    _C.CATEGORY_SPACE: str.isspace,
    _C.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
    _C.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
    _C.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
}


def backtracking_risk(pattern: str) -> str | None:
    """Why ``pattern`` may backtrack catastrophically, or None: a simple heuristic, not a proof.

    Inside a group repeated more than once (``*``, ``+``, ``{n,}``, ``{n}`` with n > 1) it looks for

    * a **nested quantifier**: a variable-length repeat (``+``, ``*``, ``{m,n}``) whose characters can also
      match every other required item of the group, so one stretch of text splits into iterations in
      exponentially many ways: ``(a+)+``, ``(a*)*``, ``(\\w+\\s?)*``, ``(.*a){20}`` (but not ``(\\.\\d+)*``,
      where the ``.`` separates the iterations);
    * an **ambiguous alternation**: two alternatives that can start with the same character, or one
      that is a prefix of another: ``(a|a)*``, ``(a|aa)+``, ``(ab|a|b)*``.

    Possessive repeats and atomic groups never backtrack and are not flagged. Characters are compared
    ignoring case and on a sample (ASCII and a few others). A pattern Python's ``re`` cannot parse (syntax
    only the ``regex`` package has) is not examined.
    """
    try:
        return _risk(sre_parse.parse(pattern), repeated=False)
    except (re.error, RecursionError, ValueError, TypeError):
        return None


def _risk(seq, repeated: bool) -> str | None:
    for op, av in seq:
        if op in _REPEATS:
            _, hi, body = av
            again = hi > 1
            if again and _nested(body):
                return "nested quantifier"
            found = _risk(body, repeated or again)
        elif op is _C.SUBPATTERN:
            found = _risk(av[-1], repeated)
        elif op is _C.BRANCH:
            alternatives = av[1]
            if repeated and _ambiguous(alternatives):
                return "ambiguous alternation"
            found = next((r for alt in alternatives if (r := _risk(alt, repeated))), None)
        elif op in (_C.ASSERT, _C.ASSERT_NOT):
            found = _risk(av[1], repeated)
        elif op is _C.GROUPREF_EXISTS:
            found = next((r for alt in av[1:] if alt is not None and (r := _risk(alt, repeated))), None)
        else:  # single characters, anchors, back references, possessive repeats, atomic groups
            found = None
        if found:
            return found
    return None


def _flat(seq) -> list:
    """A sequence with its groups opened (``(a(b+))`` → ``a``, ``b+``)."""
    out = []
    for op, av in seq:
        out += _flat(av[-1]) if op is _C.SUBPATTERN else [(op, av)]
    return out


def _nested(body) -> bool:
    """A repeated group's body has a variable-length repeat that can also match all its required items."""
    items = _flat(body)
    variable = [av for op, av in items if op in _REPEATS and av[1] > 1 and av[0] != av[1]]
    if not variable:
        return False
    heads = [_first(v[2]) for v in variable]
    required = [(op, av) for op, av in items if op not in _REPEATS or av[0] >= 1]
    required = [item for item in required if item[0] not in _REPEATS and item[0] is not _C.AT]
    return all(any(_overlap(item, h) for h in heads) for item in required)


def _ambiguous(alternatives) -> bool:
    """Alternatives that can start alike (an empty one: Python's parser moved a common prefix out)."""
    if any(not alt for alt in alternatives):
        return True
    heads = [_first(alt) for alt in alternatives]
    return any(_overlap(a, b) for i, a in enumerate(heads) for b in heads[i + 1 :])


def _first(seq) -> tuple | None:
    """The single-character item a sequence starts with (None: unknown)."""
    for op, av in seq:
        if op is _C.AT:
            continue
        if op in _ONE_CHAR:
            return (op, av)
        if op is _C.SUBPATTERN:
            return _first(av[-1])
        if op in _REPEATS and av[0] >= 1:
            return _first(av[2])
        return None
    return None


def _overlap(a: tuple | None, b: tuple | None) -> bool:
    """Whether two single-character items can match one character (unknown: yes)."""
    if a is None or b is None or a[0] not in _ONE_CHAR or b[0] not in _ONE_CHAR:
        return True
    return any(_matches(a, c) and _matches(b, c) for c in _SAMPLE)


def _matches(item: tuple, c: str) -> bool:
    op, av = item
    c = c.lower()
    if op is _C.LITERAL:
        return chr(av).lower() == c
    if op is _C.NOT_LITERAL:
        return chr(av).lower() != c
    if op is _C.ANY:
        return True
    negate, hit = False, False
    for kind, value in av:
        if kind is _C.NEGATE:
            negate = True
        elif kind is _C.LITERAL:
            hit = hit or chr(value).lower() == c
        elif kind is _C.RANGE:
            hit = hit or any(value[0] <= ord(x) <= value[1] for x in (c, c.upper()))
        elif kind is _C.CATEGORY:
            hit = hit or _CATEGORIES.get(value, lambda _c: True)(c)
        else:
            return True
    return hit != negate
