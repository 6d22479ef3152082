"""spec.engine.speculative: speculative decoding, rendered into `--speculative-config`.

Torch-free. Field rules live twice (CEL in the CRD, pydantic here); the rule
that needs other sections (one GPU per replica, an aggregated pool) is checked
when a pool is resolved (`check_speculative_pool`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvpilot.engine.contracts.builtin_models import BUILTIN_CONFIGS
from kvpilot.engine.contracts.speculative import (
    DRAFT,
    MAX_SPECULATIVE_TOKENS,
    NGRAM,
    SpeculativeConfig,
)
from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.rules import CelRule, validations

SpeculativeMethod = Literal["ngram", "draft"]
# a draft model is a built-in config (random weights) or a directory on a claim the pod mounts
DRAFT_SOURCE_PATTERN = (r"^(pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[^\s]*)?|"
                        rf"dummy:({'|'.join(BUILTIN_CONFIGS)}))$")
DRAFT_DIR = "/models/draft"

NEEDS_DRAFT_SOURCE = "method draft needs draftSource (pvc://claim/path or dummy:<built-in>)"
NGRAM_HAS_NO_DRAFT = "method ngram proposes from the context: remove draftSource"
LOOKUP_IS_NGRAM = "promptLookupMin/Max are for method ngram only: remove them"
LOOKUP_ORDER = "promptLookupMin must not exceed promptLookupMax: lower min or raise max"
SPECULATIVE_RULES = [
    CelRule("self.method != 'draft' || has(self.draftSource)", NEEDS_DRAFT_SOURCE,
            ".draftSource"),
    CelRule("self.method != 'ngram' || !has(self.draftSource)", NGRAM_HAS_NO_DRAFT,
            ".draftSource"),
    CelRule("self.method == 'ngram' || (!has(self.promptLookupMin) && "
            "!has(self.promptLookupMax))", LOOKUP_IS_NGRAM, ".method"),
    CelRule("!has(self.promptLookupMin) || !has(self.promptLookupMax) || "
            "self.promptLookupMin <= self.promptLookupMax", LOOKUP_ORDER, ".promptLookupMin"),
]


class SpeculativeSpec(ApiModel):
    """Speculative decoding: k draft tokens verified in one target pass, output unchanged."""

    model_config = ConfigDict(json_schema_extra=validations(SPECULATIVE_RULES))

    method: SpeculativeMethod
    """ngram: drafts copied from the prompt and output (no extra model); draft: a smaller model
    sharing the target's tokenizer proposes."""
    num_speculative_tokens: int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS)
    """Draft tokens proposed and verified per step."""
    prompt_lookup_max: int | None = Field(default=None, ge=1, le=64)
    """ngram: longest suffix looked up in the context (engine default 4)."""
    prompt_lookup_min: int | None = Field(default=None, ge=1, le=64)
    """ngram: shortest suffix looked up (engine default 2, at most promptLookupMax)."""
    draft_source: str | None = Field(default=None, pattern=DRAFT_SOURCE_PATTERN)
    """draft: pvc://claim/path (mounted read-only at /models/draft/claim) or dummy:<built-in>."""

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeSpec:
        where = "engine.speculative"
        if self.method == "draft" and self.draft_source is None:
            raise ValueError(f"{where}.method='draft': {NEEDS_DRAFT_SOURCE}")
        if self.method == "ngram" and self.draft_source is not None:
            raise ValueError(f"{where}.draftSource={self.draft_source!r}: {NGRAM_HAS_NO_DRAFT}")
        lookups = (self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method != "ngram" and lookups != (None, None):
            raise ValueError(f"{where}.method={self.method!r}: {LOOKUP_IS_NGRAM}")
        low, high = lookups
        if low is not None and high is not None and low > high:
            raise ValueError(f"{where}.promptLookupMin={low} > promptLookupMax={high}: "
                             f"{LOOKUP_ORDER}")
        return self

    def draft_claim(self) -> tuple[str, str] | None:
        """Gives (claim, path inside it) of a pvc:// draft, None otherwise."""
        source = self.draft_source
        if source is None or not source.startswith("pvc://"):
            return None
        claim, _, path = source.removeprefix("pvc://").partition("/")
        return claim, path

    def to_engine_config(self) -> SpeculativeConfig:
        """Gives the engine's config (what `--speculative-config` carries)."""
        k = self.num_speculative_tokens
        if self.method == "ngram":
            high = self.prompt_lookup_max or max(4, self.prompt_lookup_min or 0)
            return SpeculativeConfig(NGRAM, k, prompt_lookup_max=high,
                                     prompt_lookup_min=self.prompt_lookup_min or min(2, high))
        claim = self.draft_claim()
        source = self.draft_source or ""
        model = (f"{DRAFT_DIR}/{claim[0]}/{claim[1]}".rstrip("/") if claim
                 else source.removeprefix("dummy:"))
        return SpeculativeConfig(DRAFT, k, model=model)


def check_speculative_pool(speculative: SpeculativeSpec | None, gpus_per_replica: int,
                           role: str) -> None:
    """Raises ValueError naming engine.speculative when the pool cannot speculate: the engine
    verifies drafts on one rank of an aggregated pool only."""
    if speculative is None:
        return
    if gpus_per_replica > 1:
        raise ValueError(f"engine.speculative is set but each replica spans {gpus_per_replica} "
                         "GPUs (tensorParallel x pipelineParallel): speculative decoding runs "
                         "on one GPU per replica; remove engine.speculative or use topology 1")
    if role != "both":
        raise ValueError(f"engine.speculative is set on a {role} pool: speculative decoding "
                         "runs in aggregated serving only; remove it or use servingMode "
                         "aggregated")
