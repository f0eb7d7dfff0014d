"""spectune's acceptance rules: pure batched tensor math over :class:`VerifyBatch`.

``from policies import POLICIES, make_policy, VerifyBatch, Decision, verify``. Importing this
package registers every rule; each family lives in its own module.
"""

from policies import any_of, dropmatch, entropy, fly, kl_judge, lossless, topk, typical  # noqa: F401  (registers)
from policies.core import (
    Decision,
    MissingInputError,
    Policy,
    PolicyConfig,
    Rule,
    SearchRange,
    Valid,
    Verification,
    VerifyBatch,
)
from policies.emission import verify
from policies.registry import (
    POLICIES,
    Leniency,
    PolicySpec,
    Traits,
    decide_local,
    get_spec,
    lookahead,
    make_policy,
    policy_from_dict,
    traits,
)

__all__ = [
    "POLICIES",
    "Decision",
    "Leniency",
    "MissingInputError",
    "Policy",
    "PolicyConfig",
    "PolicySpec",
    "Rule",
    "SearchRange",
    "Traits",
    "Valid",
    "Verification",
    "VerifyBatch",
    "decide_local",
    "get_spec",
    "lookahead",
    "make_policy",
    "policy_from_dict",
    "traits",
    "verify",
]
