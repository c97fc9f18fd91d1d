"""Property tests of the action parser (bpo.policy.parsing.parse_action).

Contract: on any text and any admissible list, ``parse_action`` returns a ParsedAction and never
raises. When it snapped, ``text`` is an element of the admissible list; otherwise ``text`` is one
stripped line of at most ``MAX_CHARS`` characters, empty only when the raw text is blank. A
command the model wrapped in the usual chat noise snaps back to the admissible command. Time is
linear in the length of the text (a model can emit long runs of whitespace or many lines).
"""

from __future__ import annotations

import time

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bpo.policy.parsing import MAX_CHARS, ParsedAction, parse_action

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
ANY_CHAR = st.characters(exclude_categories=())  # surrogates and control characters included
NOISE = st.sampled_from(
    [
        "<action>",
        "</action>",
        "```",
        "```text\n",
        "Action:",
        "action =",
        "Command -",
        "Answer：",
        "Thought:",
        "> ",
        "- ",
        "* ",
        "1. ",
        "**",
        "`",
        '"',
        "'",
        "\n",
        "\r\n",
        "\t",
        " ",
        ".",
        "!",
        "<|im_end|>",
        "</s>",
        "assistant",
        "I will ",
        "let's ",
        "next action:",
        "final answer:",
        "\u2028",
        "\x85",
        "\x0b",
        "\x00",
        "é",
        "🙂",
        "日本語",
    ]
)
RAW = st.one_of(
    st.text(max_size=300),
    st.text(ANY_CHAR, max_size=100),
    st.lists(st.one_of(NOISE, st.text(max_size=8)), max_size=20).map("".join),
)
ADMISSIBLE = st.one_of(
    st.none(),
    st.lists(st.text(max_size=30), max_size=6),
    st.lists(st.text(ANY_CHAR, max_size=10), max_size=4),
)


def _is_blank(text: str) -> bool:
    return not text.split()


@SETTINGS
@given(raw=RAW, admissible=ADMISSIBLE, snap=st.booleans())
@example(raw="", admissible=None, snap=True)
@example(raw="\ud800 go", admissible=["go"], snap=True)
@example(raw="Action:\n", admissible=[], snap=True)
@example(raw=".", admissible=["."], snap=True)  # cleans to nothing, passes through, listed
def test_any_text_parses_to_one_command(raw, admissible, snap):
    res = parse_action(raw, admissible, snap)
    assert isinstance(res, ParsedAction) and res.raw == raw
    if res.snapped:
        assert snap and admissible is not None and res.text in admissible
        return
    assert not (snap and admissible and res.text in admissible), "listed but not marked snapped"
    assert "\n" not in res.text and "\r" not in res.text
    assert res.text == res.text.strip() and len(res.text) <= MAX_CHARS
    assert res.text or _is_blank(raw), f"{raw!r} is not blank but parsed to nothing"


SINGLE_LINE = st.text(max_size=40).map(lambda s: " ".join(s.split())).filter(bool)


@SETTINGS
@given(raw=RAW, admissible=st.lists(SINGLE_LINE, max_size=6))
def test_with_single_line_admissible_commands_the_result_is_one_line(raw, admissible):
    res = parse_action(raw, admissible)
    assert "\n" not in res.text and "\r" not in res.text
    assert res.text in admissible if res.snapped else len(res.text) <= MAX_CHARS


WORD = st.sampled_from(
    ["go", "north", "west", "take", "key", "open", "door", "look", "coin", "red", "box", "to"]
)
COMMAND = st.lists(WORD, min_size=1, max_size=4).map(" ".join)
WRAPPERS = [
    "{}",
    "<action>{}</action>",
    "Action: {}",
    "action = {}",
    "> {}",
    "`{}`",
    "**{}**",
    "{}.",
    '"{}"',
    "```\n{}\n```",
    "Thought: I should act.\nAction: {}",
    "{}<|im_end|>",
    "  {}  ",
    "- {}",
    "I will {}",
    "Next action: {}!",
    "<action>\n{}\n",
    "{}\nThought: done",
]


@SETTINGS
@given(commands=st.lists(COMMAND, min_size=1, max_size=6, unique=True), data=st.data())
def test_a_wrapped_admissible_command_snaps_back(commands, data):
    target = data.draw(st.sampled_from(commands))
    wrapper = data.draw(st.sampled_from(WRAPPERS))
    shout = data.draw(st.booleans())
    raw = wrapper.format(target.upper() if shout else target)
    res = parse_action(raw, commands)
    assert res.snapped and res.text == target, (raw, res)


def _timed(raw: str) -> float:
    t0 = time.perf_counter()
    parse_action(raw, ["go north"])
    return time.perf_counter() - t0


def test_long_whitespace_after_a_label_is_linear_time():
    """``Action`` followed by 20,000 spaces: the label regex backtracked quadratically (about
    10 s here); linear parsing takes milliseconds."""
    assert _timed("action" + " " * 20_000 + "go north") < 2.0


def test_many_distinct_lines_are_linear_time():
    """20,000 distinct lines: a list-membership check made this quadratic (about 9 s here)."""
    assert _timed("\n".join(f"line {i}" for i in range(20_000))) < 3.0
