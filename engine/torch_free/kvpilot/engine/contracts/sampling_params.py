"""Sampling parameters of one request, validated with messages that name the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to sample one request's output; names and defaults follow vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    beam_width: int = 1  # offline API only; >1 runs beam search (greedy, no sampling)
    length_penalty: float = 1.0
    structured_outputs: StructuredOutputsParams | None = None  # the output must match it
    # the first output token, sampled elsewhere with these parameters (a disaggregated
    # prefill engine): the engine emits it instead of sampling the first token
    first_token_id: int | None = None
    # OpenAI's: added to these tokens' logits before any other processing (-100 bans a
    # token, 100 all but forces it)
    logit_bias: dict[int, float] | None = None
    # kvpilot's: output tokens another engine already streamed to the client (a request the
    # router migrated); this engine replays them (stop strings, grammar, min/max_tokens) and
    # continues after them, sending only what follows
    resume_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raises ValueError naming the first bad field, its value and the fix."""
        checks: list[tuple[bool, str, object, str]] = [
            (self.n >= 1, "n", self.n, "must be at least 1"),
            (self.temperature >= 0, "temperature", self.temperature, "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 or -1 disables it)"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty,
             "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty,
             "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty,
             "must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
             "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs,
             "must be between 0 and 20"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             self.prompt_logprobs, "must be between 0 and 20"),
            (self.beam_width >= 1, "beam_width", self.beam_width, "must be at least 1"),
            (all(s for s in self.stop), "stop", self.stop, "must not contain empty strings"),
            # one grammar state per request: branches would each need their own
            (self.structured_outputs is None or (self.n == 1 and self.beam_width == 1),
             "structured_outputs", "set", "works with n=1 and no beam search only: drop it "
             "or send n=1"),
            # the grammar ends a structured output with EOS, which these would forbid
            (self.structured_outputs is None or not self.min_tokens, "min_tokens",
             self.min_tokens, "must be 0 with structured_outputs (the grammar decides the end)"),
            (self.structured_outputs is None or not self.ignore_eos, "ignore_eos",
             self.ignore_eos, "must be false with structured_outputs (the grammar ends the "
             "output with EOS)"),
            # one given token cannot seed several branches or a grammar's state
            (self.first_token_id is None or self.first_token_id >= 0, "first_token_id",
             self.first_token_id, "must be a token id >= 0"),
            (self.first_token_id is None or (self.n == 1 and self.beam_width == 1
                                             and self.structured_outputs is None),
             "first_token_id", self.first_token_id, "works with n=1, no beam search and no "
             "structured outputs only: drop it"),
            # one list of sent tokens is one completion's state
            (self.resume_token_ids is None or (self.n == 1 and self.beam_width == 1
                                               and self.first_token_id is None),
             "resume_token_ids", "set", "works with n=1, no beam search and no first_token_id "
             "only: a request with several completions cannot resume"),
            (self.resume_token_ids is None or all(t >= 0 for t in self.resume_token_ids),
             "resume_token_ids", [t for t in self.resume_token_ids or () if t < 0][:3],
             "must hold token ids >= 0"),
            (not self.logit_bias or all(isinstance(t, int) and t >= 0
                                        and -100 <= b <= 100
                                        for t, b in self.logit_bias.items()),
             "logit_bias", self.logit_bias, "maps token ids >= 0 to biases in [-100, 100]"),
        ]
        for ok, name, value, fix in checks:
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid: {name} {fix}")
