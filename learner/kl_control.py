"""The KL coefficient's controllers: fixed, or adaptive to a target KL (Ziegler et al., 2019).

"Fine-Tuning Language Models from Human Preferences" (Ziegler et al., 2019, §2.2) varies β, the weight of
the KL penalty to the reference policy, to keep the measured KL near a target:

    e_t = clip(KL_t / KL_target − 1, −0.2, 0.2)
    β_{t+1} = β_t · (1 + K_β · e_t),   K_β = n_steps / horizon

(OpenRLHF's and TRL's ``AdaptiveKLController`` are this rule.) A KL above target raises β by at most 20 % of
``n_steps / horizon`` per update, below it lowers β alike; the clip keeps one noisy batch from swinging
it. In tandem ``KL_t`` is the step's ``policy/kl`` (the configured estimator's token mean against the
reference), so ``algorithm.kl_target`` is in those units, and ``n_steps`` is the batch's trajectories.
"""

from __future__ import annotations


class FixedKLController:
    def __init__(self, value: float) -> None:
        self.value = value

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    def __init__(self, init: float, target: float, horizon: float) -> None:
        if init <= 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs init, target and horizon > 0 (got {init}, {target}, {horizon})"
            )
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


def make_kl_controller(
    kl_coef: float, kl_target: float | None, kl_horizon: float
) -> FixedKLController | AdaptiveKLController:
    if kl_target is None:
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, kl_target, kl_horizon)
