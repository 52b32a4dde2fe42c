"""Where a strategy's parameters and gradients are whole: whether ranks hold different gradients
(FSDP and other sharding strategies), and calling the LightningModule with whole parameters (the
callbacks' extra eager forwards)."""

from __future__ import annotations

import lightning as L


def shards_gradients(trainer) -> bool:
    """Whether ranks hold different gradients (FSDP, DeepSpeed, ...): all but replicated DDP."""
    if trainer.world_size <= 1:
        return False
    strategy = trainer.strategy
    replicated = (isinstance(strategy, L.pytorch.strategies.DDPStrategy)
                  and not isinstance(strategy, L.pytorch.strategies.DeepSpeedStrategy))
    return not replicated


def call_with_whole_params(trainer, pl_module, method: str, *args, **kwargs):
    """pl_module.<method>(...) where every parameter is whole. Under a sharding strategy (FSDP)
    the root's parameters are gathered only inside the wrapper's forward, so the call goes through
    it, as Lightning runs its own steps; a collective, so every rank must make the same call.
    Elsewhere a direct call: the parameters are whole, and the call stays off the wrapper's
    forward bookkeeping (DDP's reducer; its buffer broadcast, where enabled)."""
    wrapper = trainer.strategy.model
    if not shards_gradients(trainer) or wrapper is None or wrapper is pl_module:
        return getattr(pl_module, method)(*args, **kwargs)
    return trainer.strategy._forward_redirection(wrapper, pl_module, method, *args, **kwargs)
