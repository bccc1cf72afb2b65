"""Run by tests/rl/test_train_torchrun.py under torchrun: `rl.train`'s run with faults injected on rank 1 only,
given as a comma-separated list:

  nonfinite_loss  rank 1's second training loss (one computed with grad, for backward) is NaN: its share of step 2
  sync:N          rank 1's engine fails to install the adapter at its N-th install (1: rl.check's at the start,
                  then one per step that was not skipped)
and, on every rank, not a fault:
  random_advantages  seeded random advantages instead of GRPO's (the untrained tiny model scores 0 on every
                  rollout, which gives zero advantages and a zero gradient: nothing for a gradient check to compare)
"""

import sys

import torch

import rl.train as train
from rl.session import Session
from tests.rl.test_train import compose_cfg


def inject(s: Session, fault: str) -> None:
    calls = [0]
    fault, _, arg = fault.partition(":")
    if fault == "nonfinite_loss":
        real = train.policy_loss

        def policy_loss(*args, **kwargs):
            calls[0] += torch.is_grad_enabled()  # not the step's logged loss, recomputed without grad
            loss, metrics = real(*args, **kwargs)
            return (loss * float("nan") if calls[0] == 2 and torch.is_grad_enabled() else loss), metrics

        train.policy_loss = policy_loss
    elif fault == "sync":
        real = s.engine.load_adapter

        def load_adapter(*args, **kwargs):
            calls[0] += 1
            if calls[0] == int(arg):
                raise RuntimeError("injected: the engine worker died while installing the adapter")
            return real(*args, **kwargs)

        s.engine.load_adapter = load_adapter
    elif fault == "random_advantages":
        train.advantages = lambda s, scored, mask: torch.randn(
            mask.shape, generator=torch.Generator().manual_seed(s.rank)) * mask
    else:
        raise ValueError(f"unknown fault {fault!r}")


if __name__ == "__main__":
    faults, *overrides = sys.argv[1:]
    with Session(compose_cfg(overrides)) as session:
        for fault in faults.split(","):
            if session.rank == 1 or fault == "random_advantages":
                inject(session, fault)
        train.run(session)
