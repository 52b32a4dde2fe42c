"""Optimizers that torch does not provide as one class. configs/optimizer/*.yaml name a class with
`_partial_: true`; LitGPT.configure_optimizers calls it with the model's parameter groups
(LitGPT.param_groups: the one place that decides weight decay and Muon's share)."""

from __future__ import annotations

import torch

MUON_MIN_TORCH = "2.9"


def require_muon() -> None:
    """torch.optim.Muon, or an error naming optimizer=muon and this torch's version."""
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(
            f"optimizer=muon needs torch.optim.Muon (torch >= {MUON_MIN_TORCH}); the installed torch "
            f"{torch.__version__} does not have it: upgrade torch or pick optimizer=adamw"
        )


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the parameter groups marked `use_muon: True` (2-D weight matrices), AdamW
    on every other group, as one optimizer: Lightning, the LR scheduler, gradient clipping and the
    non-finite guard see one set of param_groups and one state. The groups' dicts and the state are
    shared with the two inner optimizers, so a scheduled `lr` or a loaded state reaches them.

    lr and weight_decay apply to both parts (a group's own `weight_decay` wins); with
    adjust_lr_fn="match_rms_adamw" Muon scales its update to AdamW's RMS (Moonshot's rule), so one
    lr suits both. momentum, nesterov, ns_steps, adjust_lr_fn are Muon's; betas and eps AdamW's.
    """

    # LitGPT.param_groups splits the decayed matrices into the `use_muon` group for this class
    takes_hidden_matrix_group = True
    check_available = staticmethod(require_muon)  # training/config_checks.py calls it before training

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str | None = "match_rms_adamw",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        require_muon()
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "use_muon": False})
        muon_groups = [g for g in self.param_groups if g["use_muon"]]
        adamw_groups = [g for g in self.param_groups if not g["use_muon"]]
        if not muon_groups:
            raise ValueError("optimizer=muon: no parameter group has use_muon=True (nothing for Muon to train)")
        # each inner optimizer fills its own defaults into the same group dicts
        self._muon = torch.optim.Muon(muon_groups, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self._adamw = torch.optim.AdamW(adamw_groups, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps) \
            if adamw_groups else None
        self._share_groups_and_state()

    def _share_groups_and_state(self) -> None:
        self._muon.param_groups = [g for g in self.param_groups if g["use_muon"]]
        self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state: share them again
        self._share_groups_and_state()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
        if self._adamw is not None:
            self._adamw.step()
        return loss
