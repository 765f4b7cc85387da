"""A user's policy loss, registered when imported: what `policy_loss.name=user_losses:scaled_pg` loads."""

from lit_grpo.losses import register_policy_loss


@register_policy_loss("scaled_pg", scale=1.0)
def scaled_pg(*, logprobs, old_logprobs, advantages, mask, tis_weight, scale):
    """REINFORCE times a constant, -scale·π·A·w. Shape: [B, T]."""
    return -scale * logprobs * advantages * tis_weight, {}
