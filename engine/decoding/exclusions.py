"""Request options that exclude each other, declared once: each pair, the field a refusal names
and why they cannot run together. `Generation` (engine/decoding/generate.py) checks a request
against them before any work, so every protocol refuses the same combinations the same way."""

from dataclasses import dataclass

from ..errors import InvalidRequest

# How a refusal names each option.
LABELS = {
    "speculative": "speculative decoding",
    "logprobs": "logprobs",
    "tools": "tools",
    "images": "images",
    "thinking_budget": "a thinking budget",
    "json_schema": "JSON mode (response_format)",
}


@dataclass(frozen=True)
class Exclusion:
    first: str  # a key of LABELS
    second: str
    field: str  # the request field a refusal names
    why: str


EXCLUSIONS = (
    Exclusion("speculative", "logprobs", "speculative",
              "draft-and-verify does not keep the model's own log-probabilities of each token"),
    Exclusion("speculative", "tools", "speculative",
              "tool calls are parsed and constrained token by token"),
    Exclusion("speculative", "images", "speculative",
              "the draft model does not see the images"),
    Exclusion("speculative", "thinking_budget", "speculative",
              "the budget closes the thinking block at an exact token"),
    Exclusion("speculative", "json_schema", "speculative",
              "draft-and-verify would run the grammar out of order"),
    Exclusion("json_schema", "tools", "tool_choice",
              "both constrain the answer's shape"),
)


def check_exclusions(**present: bool) -> None:
    """Raise InvalidRequest for the first declared pair of options that are both present (each
    option a key of LABELS, e.g. `check_exclusions(speculative=True, logprobs=False, ...)`)."""
    unknown = set(present) - set(LABELS)
    if unknown:
        raise ValueError(f"not an option of LABELS: {sorted(unknown)}")
    on = {name for name, given in present.items() if given}
    for rule in EXCLUSIONS:
        if rule.first in on and rule.second in on:
            raise InvalidRequest(f"{LABELS[rule.second]} cannot be combined with "
                                 f"{LABELS[rule.first]} ({rule.why}); send one or the other",
                                 field=rule.field, code="invalid_value")
