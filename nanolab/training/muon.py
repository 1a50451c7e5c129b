"""Muon for the hidden matrices and AdamW for the rest, as one ``torch.optim.Optimizer``.

Lightning's automatic optimization steps one optimizer per training step, clips its gradients,
schedules its learning rates and saves its state; a pair of optimizers would need manual
optimization. So :class:`MuonWithAdamW` owns a ``torch.optim.Muon`` and a ``torch.optim.AdamW``
and shows their parameter groups and state as its own: the LR scheduler scales every group
(each keeps its own peak LR), and ``state_dict()`` is an ordinary optimizer state dict (groups
and per-parameter state, plain tensors), so checkpoints load with ``weights_only=True`` and a
resume is exact. The updates are torch's own; nothing here re-implements them.
"""

from __future__ import annotations

from typing import Any

import torch

#: Group key saying which inner optimizer steps the group.
KIND = "nanolab_optimizer"


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over ``muon_groups``, ``torch.optim.AdamW`` over ``adamw_groups``.

    Args:
        muon_groups: Groups of 2-D weights, with Muon settings (``lr``, ``momentum``, ...).
        adamw_groups: Every other parameter, with AdamW settings per group (``weight_decay``).
        adamw_options: AdamW defaults (``lr``, ``betas``, ``eps``, ``fused``).
    """

    def __init__(
        self,
        muon_groups: list[dict[str, Any]],
        adamw_groups: list[dict[str, Any]],
        adamw_options: dict[str, Any],
    ) -> None:
        muon_groups = [g for g in muon_groups if g["params"]]
        adamw_groups = [g for g in adamw_groups if g["params"]] or adamw_groups[:1]
        self._muon = torch.optim.Muon(muon_groups) if muon_groups else None
        self._adamw = torch.optim.AdamW(adamw_groups, **adamw_options)
        for inner, kind in ((self._muon, "muon"), (self._adamw, "adamw")):
            for group in inner.param_groups if inner is not None else ():
                group[KIND] = kind
        # Optimizer.__init__ adopts these very group dicts (it fills in defaults in place), so
        # the inner optimizers and this one share them; _link() shares the state too.
        groups = [*(self._muon.param_groups if self._muon else ()), *self._adamw.param_groups]
        super().__init__(groups, defaults={})
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this one's groups and state (``load_state_dict``
        replaces both objects)."""
        for inner, kind in ((self._muon, "muon"), (self._adamw, "adamw")):
            if inner is not None:
                inner.param_groups = [g for g in self.param_groups if g[KIND] == kind]
                inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Muon step of the hidden matrices, then one AdamW step of the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._link()
        if self._muon is not None:
            self._muon.step()
        self._adamw.step()
        return loss
