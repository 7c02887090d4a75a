"""What a request asks of the sampler and when it stops (`SamplingParams`), checked where it
is made: a value no request may carry is a RequestError naming it. Part of the control plane's
contract (`afd/control.py` converts it to and from its protobuf)."""

from __future__ import annotations

from dataclasses import dataclass

from afd.errors import RequestError

MAX_CACHE_SALT = 1024  # characters
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for one bias: [-100, 100]
# Structured outputs: what a request's text is held to (services/attention/guides.py), and the
# guide's text for each kind: a JSON schema, nothing (any JSON object), a regular expression,
# a JSON list of strings (exactly one of them), an EBNF grammar
GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_GUIDE = 1 << 16  # characters
MAX_GUIDE_AFTER = 16  # tokens of the marker a guide may wait for
MAX_BAD_WORDS = 256  # token sequences one request may forbid
MAX_BAD_WORD_TOKENS = 64  # tokens in one
MAX_ALLOWED_TOKENS = 1 << 17  # token ids one request may restrict its choice to
PRIORITY_LIMIT = (1 << 31) - 1  # a priority travels as an int32


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0.0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # finish ("stop") on any of these, besides EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's plus the top k
    # None: none; k >= 0: every prompt token's (after the first) given the tokens before it,
    # plus the top k (vLLM's prompt_logprobs; with max_tokens 0, a prompt is only scored)
    prompt_logprobs: int | None = None
    # vLLM's cache_salt: requests with different salts never share prefix-cache blocks (a
    # tenant's secret, so that another cannot learn from timings which prompts were sent)
    cache_salt: str = ""
    # Penalties and biases, applied to the logits in this order before any sampling (greedy
    # too), as vLLM does: logit_bias ((token id, bias) pairs, added), repetition_penalty (on
    # the tokens of the prompt and the output: a positive logit divided by it, another
    # multiplied; 1: off), then frequency_penalty times each token's count in the output and
    # presence_penalty once per token the output holds, subtracted (OpenAI's definition).
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # After temperature, before top-k and top-p: drop the tokens whose probability is below
    # min_p times the likeliest token's (0: off).
    min_p: float = 0.0
    # vLLM's: until this many tokens are out, EOS and stop_token_ids cannot be chosen (and the
    # gateway matches no stop string in their text)
    min_tokens: int = 0
    guide_kind: str = ""  # "" (free text) or one of GUIDE_KINDS
    guide: str = ""
    # the guide holds from the token after the output first holds these tokens (a thinking
    # model's end of reasoning, as vLLM starts structured outputs there); (): from the first
    guide_after: tuple[int, ...] = ()
    # vLLM's bad_words, tokenized: the last token of each sequence cannot follow the rest of
    # it in the output (a one-token sequence: never chosen)
    bad_words: tuple[tuple[int, ...], ...] = ()
    # vLLM's allowed_token_ids: when given, only these can be chosen
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's priority: under the priority scheduling policy a lower value is admitted first
    # and preempted last (a scheduling knob, carried with the rest of what a request asks)
    priority: int = 0

    def __post_init__(self) -> None:
        problem = ""
        if self.max_tokens < 0:
            problem = f"max_tokens must be >= 0, got {self.max_tokens}"
        elif self.temperature < 0:
            problem = f"temperature must be >= 0, got {self.temperature}"
        elif not 0.0 < self.top_p <= 1.0:
            problem = f"top_p must be in (0, 1], got {self.top_p}"
        elif self.logprobs is not None and self.logprobs < 0:
            problem = f"logprobs must be >= 0, got {self.logprobs}"
        elif self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            problem = f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}"
        elif any(t < 0 for t in self.stop_token_ids):
            problem = "stop_token_ids must be >= 0"
        elif len(self.cache_salt) > MAX_CACHE_SALT:
            problem = f"cache_salt is longer than {MAX_CACHE_SALT} characters"
        elif not 0.0 < self.repetition_penalty <= 1e6:  # NaN fails too
            problem = f"repetition_penalty must be > 0, got {self.repetition_penalty}"
        elif not -2.0 <= self.frequency_penalty <= 2.0:
            problem = f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
        elif not -2.0 <= self.presence_penalty <= 2.0:
            problem = f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
        elif not 0.0 <= self.min_p <= 1.0:
            problem = f"min_p must be in [0, 1], got {self.min_p}"
        elif not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            problem = f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"
        elif self.guide_kind and self.guide_kind not in GUIDE_KINDS:
            problem = f"guide_kind must be one of {', '.join(GUIDE_KINDS)}, got {self.guide_kind!r}"
        elif len(self.guide) > MAX_GUIDE:
            problem = f"the guide is longer than {MAX_GUIDE} characters"
        elif self.guide_kind in ("", "json_object") and self.guide:
            problem = f"guide_kind {self.guide_kind!r} takes no guide"
        elif self.guide_kind not in ("", "json_object") and not self.guide:
            problem = f"guide_kind {self.guide_kind!r} needs a guide"
        elif self.guide_after and (not self.guide_kind or len(self.guide_after) > MAX_GUIDE_AFTER):
            problem = f"guide_after needs a guide and at most {MAX_GUIDE_AFTER} tokens"
        elif any(t < 0 for t in self.guide_after):
            problem = "guide_after's token ids must be >= 0"
        elif len(self.bad_words) > MAX_BAD_WORDS or not all(
            0 < len(w) <= MAX_BAD_WORD_TOKENS and min(w) >= 0 for w in self.bad_words
        ):
            problem = (
                f"bad_words must be at most {MAX_BAD_WORDS} sequences of 1 to "
                f"{MAX_BAD_WORD_TOKENS} token ids >= 0"
            )
        elif len(self.allowed_token_ids) > MAX_ALLOWED_TOKENS or any(
            t < 0 for t in self.allowed_token_ids
        ):
            problem = f"allowed_token_ids must be at most {MAX_ALLOWED_TOKENS} token ids >= 0"
        elif not -PRIORITY_LIMIT <= self.priority <= PRIORITY_LIMIT:
            problem = f"priority must be in [-{PRIORITY_LIMIT}, {PRIORITY_LIMIT}]"
        else:
            problem = _logit_bias_problem(self.logit_bias)
        if problem:
            raise RequestError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias or a penalty changes this request's logits before sampling."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
        )


def _logit_bias_problem(bias: tuple[tuple[int, float], ...]) -> str:
    if len(bias) > MAX_LOGIT_BIAS:
        return f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed"
    seen = set()
    for token, value in bias:
        if token < 0:
            return f"logit_bias names token {token}; token ids are >= 0"
        if token in seen:
            return f"logit_bias names token {token} twice"
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:  # NaN fails too
            return f"logit_bias for token {token} is {value}; it must be in [-100, 100]"
        seen.add(token)
    return ""
