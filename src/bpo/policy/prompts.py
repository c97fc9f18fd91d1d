"""Agent prompts through the model's own chat template, append-only at the token level.

An episode's context is built as: ``start`` (system prompt, the task's instruction, the first
observation and its admissible actions, the assistant generation prompt), then per turn the
sampled action tokens *exactly as sampled* followed by ``extend``'s tokens (the end-of-turn
marker, the next observation as a user message, the next generation prompt). For a chat template
that renders turns by concatenation (ChatML as in Qwen2 / SmolLM2, Llama-3, ...) the result
equals tokenising the whole chat, when the actions are the canonical tokenisation of their text;
with sampled actions the context keeps the sampled ids (never re-tokenised), so the prefix cache
and the learner see the same tokens.

End of turn: the sampled action may end with the end-of-turn token (``<|im_end|>`` is SmolLM2's
eos) or not (``max_new_tokens`` reached, or another stop token). ``extend`` does not repeat an
end-of-turn token the action already ends with.

Context budget: when ``max_context_tokens`` is set and the next context plus ``reserve_tokens``
(room for the next action) would exceed it, ``extend`` performs a **context reset**: it renders
a fresh chat with the system prompt, the instruction and only the most recent turns that fit in
``reset_fraction`` of the budget (earlier turns are dropped; the kept turns' actions appear as
re-tokenised text, which is context, not trained tokens). The new state has ``reset=True`` and
``ids`` is the whole new context, not an extension: the rollout engine must use it as is (and
the prefix cache simply computes it anew). Dropping to a fraction of the budget makes resets rare.

States are immutable, so siblings at a branch node each extend the same state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent in a text environment. Each turn you see an observation and reply with "
    "exactly one action: a short command such as 'go north' or 'take key', and nothing else."
)
_SENTINEL = "\u2063<<bpo-action>>\u2063"


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be extended append-only."""


class ContextBudgetError(ValueError):
    """Even the smallest context (system prompt, instruction, latest observation) exceeds
    ``max_context_tokens``."""


@dataclass(frozen=True)
class Exchange:
    """One past turn: the action taken and what the environment answered."""

    action: str
    observation: str
    admissible: tuple[str, ...] | None


@dataclass(frozen=True)
class PromptState:
    """An episode's context after some turns (immutable; extend it to get the next one)."""

    ids: tuple[int, ...]
    """The whole context for the next action."""
    new_ids: tuple[int, ...]
    """Tokens added by the call that made this state: after ``start`` or a reset, all of
    ``ids``; after an ordinary ``extend``, the tokens that follow the action's tokens."""
    reset: bool
    """True when ``extend`` rebuilt the context to fit the budget (``ids`` is then not the
    previous context + action + ``new_ids``)."""
    instruction: str
    observation: str
    """The first observation of the episode."""
    admissible: tuple[str, ...] | None
    history: tuple[Exchange, ...] = ()
    kept_from: int = 0
    """Index of the first exchange still shown in the context (grows at each reset)."""

    @property
    def num_turns(self) -> int:
        return len(self.history)


@dataclass(frozen=True)
class PromptBuilder:
    """Builds agent contexts with ``tokenizer``'s chat template (see the module docstring)."""

    tokenizer: Any
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    """None: no system message (the template may insert its own default)."""
    max_admissible: int | None = 30
    """Admissible actions listed per observation (the rest are counted); None hides the list."""
    max_context_tokens: int | None = None
    """Context budget in tokens (None = unbounded; the policy still checks model positions)."""
    reserve_tokens: int = 64
    """Room kept for the next action when checking the budget (the sampling max_new_tokens)."""
    reset_fraction: float = 0.5
    """A reset keeps only the recent turns that fit in this fraction of the budget."""

    # ------------------------------------------------------------------ public API

    def start(
        self, instruction: str, observation: str, admissible: Sequence[str] | None = None
    ) -> PromptState:
        """The first context of an episode."""
        adm = tuple(admissible) if admissible is not None else None
        state = PromptState((), (), False, instruction, observation, adm)
        ids = self._tokenize(self._render(self._messages(state), generation=True))
        if self._over_budget(len(ids), 1.0):
            raise ContextBudgetError(
                f"the first context has {len(ids)} tokens (+{self.reserve_tokens} reserved) but "
                f"max_context_tokens={self.max_context_tokens}; raise the budget or shorten "
                "the instruction / observation"
            )
        return PromptState(ids, ids, False, instruction, observation, adm)

    def extend(
        self,
        state: PromptState,
        action_ids: Sequence[int],
        observation: str,
        admissible: Sequence[str] | None = None,
    ) -> PromptState:
        """The context after ``action_ids`` (as sampled) and the environment's answer."""
        action_ids = tuple(int(t) for t in action_ids)
        text = self.tokenizer.decode(action_ids, skip_special_tokens=True)
        adm = tuple(admissible) if admissible is not None else None
        shown = self._messages(state)
        before = self._render(shown, generation=True)
        after = self._render(
            [*shown, _msg("assistant", _SENTINEL), _msg("user", self._user(observation, adm))],
            generation=True,
        )
        if not after.startswith(before + _SENTINEL):
            raise ChatTemplateError(
                "the chat template does not render a conversation append-only (the text before "
                "an assistant turn changes when the turn is added); choose a template that "
                "renders turns by concatenation, such as ChatML"
            )
        tail = self._tokenize(after[len(before) + len(_SENTINEL) :])
        if action_ids and tail and tail[0] == action_ids[-1]:
            tail = tail[1:]  # the action already ends with the end-of-turn token
        history = (*state.history, Exchange(text, observation, adm))
        ids = state.ids + action_ids + tail
        nxt = PromptState(
            ids, tail, False, state.instruction, state.observation, state.admissible, history,
            state.kept_from,
        )  # fmt: skip
        if self._over_budget(len(ids), 1.0):
            return self._reset(nxt)
        return nxt

    def render(self, state: PromptState) -> str:
        """The chat text of ``state`` (for logs; the ids are the source of truth)."""
        return self._render(self._messages(state), generation=True)

    # ------------------------------------------------------------------ context reset

    def _reset(self, state: PromptState) -> PromptState:
        """Keep the most recent turns that fit in ``reset_fraction`` of the budget."""
        n = len(state.history)
        ids = self._ids_from(state, n)
        if self._over_budget(len(ids), 1.0):
            raise ContextBudgetError(
                f"even the smallest context (system, instruction, latest observation) has "
                f"{len(ids)} tokens (+{self.reserve_tokens} reserved), over "
                f"max_context_tokens={self.max_context_tokens}"
            )
        lo, hi = state.kept_from + 1, n  # binary search the smallest kept_from that fits
        while lo < hi:
            mid = (lo + hi) // 2
            if self._over_budget(len(self._ids_from(state, mid)), self.reset_fraction):
                lo = mid + 1
            else:
                hi = mid
        ids = self._ids_from(state, lo)
        return PromptState(
            ids, ids, True, state.instruction, state.observation, state.admissible,
            state.history, lo,
        )  # fmt: skip

    def _ids_from(self, state: PromptState, kept_from: int) -> tuple[int, ...]:
        probe = PromptState(
            (), (), True, state.instruction, state.observation, state.admissible, state.history,
            kept_from,
        )  # fmt: skip
        return self._tokenize(self._render(self._messages(probe), generation=True))

    def _over_budget(self, n_tokens: int, fraction: float) -> bool:
        if self.max_context_tokens is None:
            return False
        return n_tokens + self.reserve_tokens > fraction * self.max_context_tokens

    # ------------------------------------------------------------------ rendering

    def _messages(self, state: PromptState) -> list[dict[str, str]]:
        k = state.kept_from
        msgs = [_msg("system", self.system_prompt)] if self.system_prompt is not None else []
        if k == 0:
            first = self._user(state.observation, state.admissible, state.instruction)
        else:
            last = state.history[k - 1]
            first = self._user(last.observation, last.admissible, state.instruction, omitted=k)
        msgs.append(_msg("user", first))
        for ex in state.history[k:]:
            msgs += [
                _msg("assistant", ex.action),
                _msg("user", self._user(ex.observation, ex.admissible)),
            ]
        return msgs

    def _user(
        self,
        observation: str,
        admissible: tuple[str, ...] | None,
        instruction: str | None = None,
        omitted: int = 0,
    ) -> str:
        parts = []
        if instruction is not None:
            parts.append(instruction)
        if omitted:
            parts.append(f"({omitted} earlier turns omitted.)")
        parts.append(observation)
        if admissible is not None and self.max_admissible is not None:
            shown = list(admissible[: self.max_admissible])
            more = len(admissible) - len(shown)
            listed = ", ".join(shown) + (f", ... ({more} more)" if more > 0 else "")
            parts.append(f"Valid actions: {listed}")
        return "\n\n".join(p for p in parts if p)

    def _render(self, messages: list[dict[str, str]], generation: bool) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ChatTemplateError(
                "the tokenizer has no chat template; use a chat model or 'bpo init-model' "
                "(which installs ChatML)"
            )
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
        return str(text)

    def _tokenize(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _msg(role: str, content: str | None) -> dict[str, str]:
    return {"role": role, "content": content or ""}
