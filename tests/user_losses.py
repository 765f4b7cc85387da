"""A user's policy loss, registered when imported: what `policy_loss.name=user_losses:scaled_pg` loads."""

from lit_grpo.maths.losses import register_policy_loss


@register_policy_loss("scaled_pg", scale=1.0)
def scaled_pg(*, logprobs, old_logprobs, advantages, mask, tis_weight, scale):
    """REINFORCE times a constant, -scale·π·A·w. Shape: [B, T]."""
    return -scale * logprobs * advantages * tis_weight, {}


NAN_ON_CALLS: set[int] = set()
_calls = {"n": 0}


@register_policy_loss("nan_on_calls")
def nan_on_calls(*, logprobs, old_logprobs, advantages, mask, tis_weight):
    """REINFORCE, except NaN on the calls listed in `NAN_ON_CALLS` (all calls when it holds -1). Shape: [B, T]."""
    _calls["n"] += 1
    loss_BT = -logprobs * advantages * tis_weight
    if _calls["n"] in NAN_ON_CALLS or -1 in NAN_ON_CALLS:
        loss_BT = loss_BT * float("nan")
    return loss_BT, {}
