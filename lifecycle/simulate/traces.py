"""Synthetic serving traces: seeded, deterministic multi-turn chats for :func:`~lifecycle.simulate.simulate`.

:func:`multi_turn_trace` builds a trace of multi-turn chats: a few system prompts shared with
Zipf-like popularity, several LoRA adapters (and requests without one), and turns whose prompt is
the previous turn's prompt, its response and a new user message. :func:`trace_for_model` scales
its lengths to fit a model; :func:`max_turns` and :func:`trace_nbytes` size a run before it is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from lifecycle.config import ModelConfig
from lifecycle.errors import ConfigError

__all__ = [
    "DEFAULT_ADAPTERS",
    "MAX_TURN_SHRINK",
    "Request",
    "max_turns",
    "multi_turn_trace",
    "trace_for_model",
    "trace_nbytes",
]

#: Adapter names the default trace serves (besides requests without an adapter).
DEFAULT_ADAPTERS: Final[tuple[str, ...]] = ("chat-lora", "code-lora", "support-lora")
#: ``trace_for_model`` shortens messages so that a whole chat fits the model. Shortened more than
#: this many times below what a one-turn chat needs, more turns would only make another trace.
MAX_TURN_SHRINK: Final = 8
#: Memory of one ``Request`` besides its token ids: the object, two array headers, a list slot.
_REQUEST_OVERHEAD_BYTES: Final = 512
_SYSTEM_TOKENS: Final = (256, 1024)
_USER_TOKENS: Final = (16, 128)
_RESPONSE_TOKENS: Final = (32, 384)



@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One turn of one chat. ``response`` holds the tokens the simulated engine generates (so the
    next turn of the chat can include them); ``adapter`` is None for the base model."""

    request_id: int
    chat_id: int
    turn: int
    adapter: str | None
    prompt: npt.NDArray[np.int32]
    response: npt.NDArray[np.int32]

    @property
    def max_new_tokens(self) -> int:
        return int(self.response.shape[0])

    @property
    def total_tokens(self) -> int:
        """Tokens the sequence reaches: prompt and response."""
        return int(self.prompt.shape[0] + self.response.shape[0])


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}")


def _check_range(name: str, bounds: tuple[int, int], minimum: int) -> None:
    low, high = bounds
    if not (isinstance(low, int) and isinstance(high, int)) or low < minimum or high < low:
        raise ConfigError(f"{name}={bounds!r} must be (low, high) ints with {minimum} <= low <= high")


def _zipf_weights(n: int, exponent: float) -> npt.NDArray[np.float64]:
    weights = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    weights /= weights.sum()
    return weights


@dataclass(slots=True, eq=False)
class _Chat:
    """An open chat while a trace is generated: ``context`` is everything said so far."""

    chat_id: int
    turns_left: int
    adapter: str | None
    context: npt.NDArray[np.int32]
    turn: int = 0


def multi_turn_trace(
    seed: int,
    num_chats: int,
    turns: int,
    *,
    min_turns: int | None = None,
    num_system_prompts: int = 8,
    system_prompt_tokens: tuple[int, int] = (256, 1024),
    user_tokens: tuple[int, int] = (16, 128),
    response_tokens: tuple[int, int] = (32, 384),
    adapters: Sequence[str] = DEFAULT_ADAPTERS,
    no_adapter_fraction: float = 0.25,
    concurrent_chats: int = 16,
    zipf_exponent: float = 1.1,
    vocab_size: int = 32_000,
    max_requests: int | None = None,
) -> list[Request]:
    """A deterministic trace (same arguments, same tokens) of ``num_chats`` chats of ``turns``
    turns each (or uniformly ``min_turns..turns``), in arrival order.

    Each chat picks a system prompt and an adapter (none with probability ``no_adapter_fraction``),
    both Zipf-distributed; turn ``t``'s prompt is turn ``t-1``'s prompt + its response + a new user
    message. Arrivals interleave ``concurrent_chats`` open chats, so a chat's turns appear in order
    but far apart. ``max_requests`` cuts the trace (a chat's turns are cut from its end). Token ids
    lie in ``[1, vocab_size)``.
    """
    _check_count("num_chats", num_chats, 0)
    _check_count("turns", turns, 1)
    low_turns = turns if min_turns is None else min_turns
    _check_count("min_turns", low_turns, 1)
    if low_turns > turns:
        raise ConfigError(f"min_turns={low_turns} must be <= turns={turns}")
    _check_count("num_system_prompts", num_system_prompts, 1)
    _check_range("system_prompt_tokens", system_prompt_tokens, 0)
    _check_range("user_tokens", user_tokens, 1)
    _check_range("response_tokens", response_tokens, 1)
    _check_count("concurrent_chats", concurrent_chats, 1)
    _check_count("vocab_size", vocab_size, 2)
    if max_requests is not None:
        _check_count("max_requests", max_requests, 0)
    if not 0.0 <= no_adapter_fraction <= 1.0:
        raise ConfigError(f"no_adapter_fraction={no_adapter_fraction!r} must lie in [0, 1]")
    if not adapters and no_adapter_fraction < 1.0:
        raise ConfigError("adapters is empty, so no_adapter_fraction must be 1.0")
    if len(set(adapters)) != len(adapters) or not all(isinstance(a, str) and a for a in adapters):
        raise ConfigError(f"adapters={list(adapters)!r} must be distinct non-empty names")

    rng = np.random.default_rng(seed)

    def tokens(bounds: tuple[int, int]) -> npt.NDArray[np.int32]:
        length = int(rng.integers(bounds[0], bounds[1] + 1))
        return rng.integers(1, vocab_size, length, dtype=np.int32)

    system_prompts = [tokens(system_prompt_tokens) for _ in range(num_system_prompts)]
    prompt_weights = _zipf_weights(num_system_prompts, zipf_exponent)
    adapter_weights = _zipf_weights(len(adapters), zipf_exponent) if adapters else None

    def open_chat(chat_id: int) -> _Chat:
        context = system_prompts[int(rng.choice(num_system_prompts, p=prompt_weights))]
        turns_left = int(rng.integers(low_turns, turns + 1))
        use_base = adapter_weights is None or rng.random() < no_adapter_fraction
        adapter = None if use_base else adapters[int(rng.choice(len(adapters), p=adapter_weights))]
        return _Chat(chat_id, turns_left, adapter, context)

    limit = max_requests if max_requests is not None else num_chats * turns
    trace: list[Request] = []
    next_chat = min(concurrent_chats, num_chats)
    open_chats = [open_chat(chat_id) for chat_id in range(next_chat)]
    while open_chats and len(trace) < limit:
        index = int(rng.integers(len(open_chats)))
        chat = open_chats[index]
        prompt = np.concatenate((chat.context, tokens(user_tokens)))
        response = tokens(response_tokens)
        trace.append(Request(len(trace), chat.chat_id, chat.turn, chat.adapter, prompt, response))
        chat.context = np.concatenate((prompt, response))
        chat.turn += 1
        chat.turns_left -= 1
        if chat.turns_left == 0:
            if next_chat < num_chats:
                open_chats[index] = open_chat(next_chat)
                next_chat += 1
            else:
                open_chats.pop(index)
    return trace


@dataclass(frozen=True, slots=True)
class _ChatShape:
    """Message lengths ``trace_for_model`` uses for chats of some number of turns on a model."""

    budget: int  # tokens one chat may reach: a quarter of the pool, within the per-sequence limit
    scale: float
    system: tuple[int, int]
    user: tuple[int, int]
    response: tuple[int, int]

    @staticmethod
    def of(
        config: ModelConfig,
        turns: int,
        system_prompt_tokens: tuple[int, int],
        user_tokens: tuple[int, int],
        response_tokens: tuple[int, int],
    ) -> _ChatShape:
        budget = min(config.num_blocks_resolved // 4, config.max_blocks_per_seq_resolved) * config.block_size
        longest = system_prompt_tokens[1] + turns * (user_tokens[1] + response_tokens[1])
        scale = min(1.0, budget / longest) if longest else 1.0

        def scaled(bounds: tuple[int, int], minimum: int) -> tuple[int, int]:
            return (max(int(bounds[0] * scale), minimum), max(int(bounds[1] * scale), minimum))

        return _ChatShape(
            budget, scale, scaled(system_prompt_tokens, 0), scaled(user_tokens, 1), scaled(response_tokens, 1)
        )

    def fits(self, turns: int) -> bool:
        return self.system[1] + turns * (self.user[1] + self.response[1]) <= self.budget


def max_turns(
    config: ModelConfig,
    *,
    system_prompt_tokens: tuple[int, int] = _SYSTEM_TOKENS,
    user_tokens: tuple[int, int] = _USER_TOKENS,
    response_tokens: tuple[int, int] = _RESPONSE_TOKENS,
) -> int:
    """The most turns per chat :func:`trace_for_model` accepts for ``config``: chats that fit, with
    messages shortened at most ``MAX_TURN_SHRINK`` times more than a one-turn chat's (0: not even
    one turn fits)."""
    lengths = (system_prompt_tokens, user_tokens, response_tokens)
    floor = _ChatShape.of(config, 1, *lengths).scale / MAX_TURN_SHRINK

    def accepted(turns: int) -> bool:
        shape = _ChatShape.of(config, turns, *lengths)
        return shape.fits(turns) and shape.scale >= floor

    low, high = 0, max(config.num_blocks_resolved * config.block_size, 1)  # every turn takes >= 2 tokens
    while low < high:
        middle = (low + high + 1) // 2
        if accepted(middle):
            low = middle
        else:
            high = middle - 1
    return low


def trace_nbytes(
    config: ModelConfig,
    *,
    num_requests: int,
    turns: int,
    system_prompt_tokens: tuple[int, int] = _SYSTEM_TOKENS,
    user_tokens: tuple[int, int] = _USER_TOKENS,
    response_tokens: tuple[int, int] = _RESPONSE_TOKENS,
) -> int:
    """About how much memory a :func:`trace_for_model` trace takes (its mean, to size a run
    before generating it): every request holds its whole prompt and its response."""
    shape = _ChatShape.of(config, turns, system_prompt_tokens, user_tokens, response_tokens)

    def mean(bounds: tuple[int, int]) -> float:
        return (bounds[0] + bounds[1]) / 2

    # Chats have 1..turns turns, so a request is on average (turns - 1) / 3 turns deep.
    message = mean(shape.user) + mean(shape.response)
    tokens = mean(shape.system) + (turns - 1) / 3 * message + message
    return int(num_requests * (4 * tokens + _REQUEST_OVERHEAD_BYTES))


def trace_for_model(
    config: ModelConfig,
    *,
    seed: int,
    num_requests: int,
    turns: int,
    system_prompt_tokens: tuple[int, int] = _SYSTEM_TOKENS,
    user_tokens: tuple[int, int] = _USER_TOKENS,
    response_tokens: tuple[int, int] = _RESPONSE_TOKENS,
    **trace_options: Any,
) -> list[Request]:
    """:func:`multi_turn_trace` of ``num_requests`` requests from chats of ``1..turns`` turns, with
    every length scaled down (never up) so that a whole chat fits a quarter of ``config``'s KV pool
    and its per-sequence limit, and no more adapters than ``config`` has adapter slots. Raises
    ``ConfigError`` when even the shortest chat cannot fit, or for more turns than
    :func:`max_turns` (where only ever shorter messages would make room)."""
    _check_count("num_requests", num_requests, 0)
    _check_count("turns", turns, 1)
    shape = _ChatShape.of(config, turns, system_prompt_tokens, user_tokens, response_tokens)
    system, user, response = shape.system, shape.user, shape.response
    if not shape.fits(turns):
        raise ConfigError(
            f"a KV pool of {config.num_blocks_resolved} blocks of {config.block_size} tokens is too small for "
            f"chats of {turns} turns (each chat must fit a quarter of the pool); use more blocks or fewer turns"
        )
    limit = max_turns(
        config, system_prompt_tokens=system_prompt_tokens, user_tokens=user_tokens, response_tokens=response_tokens
    )
    if turns > limit:
        raise ConfigError(
            f"turns={turns} is more than the {limit} turns a chat may have on {config.num_blocks_resolved} blocks of "
            f"{config.block_size} tokens: its messages would be shortened more than {MAX_TURN_SHRINK} times below "
            "a one-turn chat's; use more blocks or fewer turns"
        )
    # One adapter per slot at most, so every adapter of the trace stays loaded.
    adapters = tuple(trace_options.pop("adapters", DEFAULT_ADAPTERS))[: config.num_adapter_slots]
    if not adapters:
        trace_options["no_adapter_fraction"] = 1.0
    return multi_turn_trace(
        seed,
        num_requests,
        turns,
        adapters=adapters,
        min_turns=1,
        system_prompt_tokens=system,
        user_tokens=user,
        response_tokens=response,
        max_requests=num_requests,
        **trace_options,
    )

